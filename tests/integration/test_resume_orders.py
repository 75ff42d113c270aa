"""A resume in either order a script may have ends where the uninterrupted run (DDP's resume) ends:
the docs' order (``DistributedOptimizer.load_state_dict`` after construction) and DDP scripts' order
(``optimizer.load_state_dict`` on the torch optimizer before ``client.init``, imagenet's and
nanoGPT's), with the lr driven after the load by a LambdaLR (SGD momentum) or by writes to
``opt.param_groups`` every step (AdamW, two groups, nanoGPT's loop). Through real shards (2 shards,
2 workers, sync), against one torch process stepping the ranks' mean gradient."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ps_worker import DistributedOptimizer, PSClient
from tests.conftest import RPC_TIMEOUT, small_model
from tests.integration.test_ddp_semantics import run_ranks
from tests.integration.test_optimizer_state import (
    BATCH,
    NO_DECAY,
    PARTITION_BYTES,
    WORKERS,
    assert_state_equal,
    batches,
    reference_step,
)

N, M = 3, 3
TOLERANCE = 1e-5


def factor(step: int) -> float:
    """The LambdaLR factor: warm-up over 2 steps, then cosine."""
    return (step + 1) / 2 if step < 2 else 0.5 * (1 + math.cos(math.pi * (step - 2) / (N + M)))


def lr_at(step: int) -> float:
    """nanoGPT's per-step lr (written into every group; the biases' group at half of it)."""
    return 0.01 * factor(step)


def build(case: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if case == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    named = dict(model.named_parameters())
    decay = [p for k, p in named.items() if k not in NO_DECAY]
    no_decay = [named[k] for k in NO_DECAY]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=0.01, betas=(0.9, 0.95))


def set_lr(opt: torch.optim.Optimizer, step: int) -> None:
    for i, g in enumerate(opt.param_groups):  # nanoGPT: for param_group in optimizer.param_groups
        g["lr"] = lr_at(step) * (1.0, 0.5)[i]


def scheduler(case: str, opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, factor) if case == "sgd" else None


def loss(model: torch.nn.Module, t: int, rank: int) -> torch.Tensor:
    x, y = batches(t)
    return F.cross_entropy(model(x[rank * BATCH : (rank + 1) * BATCH]), y[rank * BATCH : (rank + 1) * BATCH])


def reference(case: str, stop: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    """One torch process from step 0 to ``stop``; its weights and a DDP-style checkpoint."""
    model = small_model()
    opt = build(case, model)
    sched = scheduler(case, opt)
    for t in range(stop):
        if sched is None:
            set_lr(opt, t)
        reference_step(model, opt, t)
        if sched is not None:
            sched.step()
    ckpt = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(opt.state_dict())}
    ckpt["scheduler"] = sched.state_dict() if sched is not None else None
    return model, ckpt


def train(addresses: list[str], case: str, steps: range, order: str, ckpt: dict[str, Any] | None) -> dict[str, Any]:
    """Every rank runs the script: resume from ``ckpt`` in ``order`` ("docs": into the
    DistributedOptimizer after it is built; "ddp": into the torch optimizer, and the scheduler,
    before the client), then ``steps``; returns rank 0's checkpoint (weights, optimizer, scheduler)."""
    models = [small_model() for _ in range(WORKERS)]  # before the threads: small_model seeds the global RNG

    def work(rank: int) -> dict[str, Any]:
        model = models[rank]
        if ckpt is not None:
            model.load_state_dict(ckpt["model"])
        own = build(case, model)
        sched = None
        if order == "ddp":  # imagenet, nanoGPT: the scheduler, then the checkpoint, then DDP (here: the client)
            sched = scheduler(case, own)
            if ckpt is not None:
                own.load_state_dict(copy.deepcopy(ckpt["optimizer"]))
                if sched is not None:
                    sched.load_state_dict(ckpt["scheduler"])
        with PSClient(
            addresses, rank=rank, num_workers=WORKERS, timeout=RPC_TIMEOUT, partition_bytes=PARTITION_BYTES
        ) as client:
            client.init(model, own)
            opt = DistributedOptimizer(model, client, own)
            if order == "docs":
                sched = scheduler(case, opt)
                if ckpt is not None:
                    opt.load_state_dict(copy.deepcopy(ckpt["optimizer"]))
                    if sched is not None:
                        sched.load_state_dict(ckpt["scheduler"])
            assert not own.state, "the torch optimizer's state went to the shards"
            for t in steps:
                if sched is None:
                    set_lr(opt, t)
                opt.zero_grad()
                loss(model, t, rank).backward()
                opt.step()
                if sched is not None:
                    sched.step()
            state = opt.state_dict()
            assert_state_equal(own.state_dict()["state"], state["state"])  # what a script saving its own holds
            return {
                "model": copy.deepcopy(model.state_dict()),
                "optimizer": state,
                "scheduler": sched.state_dict() if sched is not None else None,
            }

    return run_ranks(WORKERS, work)[0]


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for k in b:
        diff = (a[k] - b[k]).abs().max().item()
        assert diff <= TOLERANCE, f"{k}: max |difference| {diff:.3g} > {TOLERANCE}"


@pytest.mark.parametrize("order", ["docs", "ddp"])
@pytest.mark.parametrize("case", ["sgd", "adamw"], ids=["sgd-momentum-lambdalr", "adamw-two-groups-lr-writes"])
def test_resume_in_either_order_ends_as_the_uninterrupted_run(start_cluster, case: str, order: str) -> None:
    whole, _ = reference(case, N + M)
    saved = train(start_cluster(num_shards=2, num_workers=WORKERS).addresses, case, range(N), order, None)
    start_cluster.stop_all()
    _, torch_ckpt = reference(case, N)
    assert_close(saved["model"], torch_ckpt["model"])
    lrs = [g["lr"] for g in saved["optimizer"]["param_groups"]]
    assert lrs == [g["lr"] for g in torch_ckpt["optimizer"]["param_groups"]], lrs
    resumed = train(start_cluster(num_shards=2, num_workers=WORKERS).addresses, case, range(N, N + M), order, saved)
    assert_close(resumed["model"], whole.state_dict())
    assert not torch.equal(resumed["model"]["0.weight"], saved["model"]["0.weight"])  # it trained


@pytest.mark.parametrize("case", ["sgd", "adamw"])
def test_a_ddp_runs_checkpoint_loaded_before_the_client_continues_that_run(start_cluster, case: str) -> None:
    """The checkpoint of a torch run (what DDP's rank 0 saves) loaded where a DDP script loads it."""
    whole, _ = reference(case, N + M)
    _, ckpt = reference(case, N)
    resumed = train(start_cluster(num_shards=2, num_workers=WORKERS).addresses, case, range(N, N + M), "ddp", ckpt)
    assert_close(resumed["model"], whole.state_dict())


def test_without_the_state_the_resume_differs(start_cluster) -> None:
    """The check above has teeth: the same resume with the torch optimizer's state dropped ends elsewhere."""
    whole, _ = reference("adamw", N + M)
    _, ckpt = reference("adamw", N)
    ckpt["optimizer"]["state"] = {}
    resumed = train(start_cluster(num_shards=2, num_workers=WORKERS).addresses, "adamw", range(N, N + M), "ddp", ckpt)
    diff = max((resumed["model"][k] - v).abs().max().item() for k, v in whole.state_dict().items())
    assert diff > 100 * TOLERANCE


def test_writes_after_a_load_reach_the_shards(start_cluster, tmp_path: Path) -> None:
    """After DistributedOptimizer.load_state_dict (and after a load into the wrapped torch optimizer),
    opt.param_groups are still the dicts each push reads: an lr of 0 written there stops training."""
    addresses = start_cluster(num_shards=2, num_workers=1).addresses
    model = small_model()
    own = build("adamw", model)
    with PSClient(addresses, rank=0, num_workers=1, timeout=RPC_TIMEOUT, partition_bytes=PARTITION_BYTES) as client:
        client.init(model, own)
        opt = DistributedOptimizer(model, client, own)
        opt.zero_grad()
        loss(model, 0, 0).backward()
        opt.step()
        for load in (opt.load_state_dict, own.load_state_dict):
            load(opt.state_dict())
            assert opt.param_groups is not own.param_groups
            assert all(a is b for a, b in zip(opt.param_groups, own.param_groups, strict=True))
            for g in opt.param_groups:
                g["lr"] = 0.0
            assert [h["lr"] for h in opt.hyperparameters()] == [0.0, 0.0]
            before = copy.deepcopy(model.state_dict())
            opt.zero_grad()
            loss(model, 1, 0).backward()
            opt.step()
            for k, v in model.state_dict().items():  # AdamW with lr 0: no decay, no step
                assert torch.equal(v, before[k]), k
            for g in opt.param_groups:
                g["lr"] = 0.01
