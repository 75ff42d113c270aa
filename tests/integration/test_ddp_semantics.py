"""DistributedOptimizer behaves like a torch optimizer and, in sync mode, like DDP: schedulers,
AMP, accumulation, clipping, per-group hyperparameters, state_dict; through real shards."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import torch.nn.functional as F

from ps_common.plan import DEFAULT_PARTITION_BYTES
from ps_worker import DistributedOptimizer, PSClient
from tests.conftest import RPC_TIMEOUT, small_model
from tests.helpers import ddp_script

ROOT = Path(__file__).resolve().parents[2]

BATCH = 8


def data(n: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def run_ranks(n: int, work: Callable[[int], Any], timeout: float = 60.0) -> list[Any]:
    """Run ``work(rank)`` for every rank in threads; re-raise the first error; bounded."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return factor


def assert_close(a: torch.nn.Module, b: torch.nn.Module, tol: float = 1e-5) -> None:
    for (key, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        diff = (p.double() - q.double()).abs().max().item()
        assert diff <= tol, f"{key}: max abs difference {diff}"


def test_distributed_optimizer_is_a_torch_optimizer(start_cluster) -> None:
    shards = start_cluster(num_shards=2, num_workers=1)
    model = small_model()
    with PSClient([s.address for s in shards], rank=0, num_workers=1, timeout=RPC_TIMEOUT) as client:
        client.init(model, {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": 1})
        opt = DistributedOptimizer(model, client)
        assert isinstance(opt, torch.optim.Optimizer)
        (group,) = opt.param_groups
        assert group["lr"] == 0.1 and group["momentum"] == 0.9 and "nesterov" not in group
        assert len(group["params"]) == len(list(model.parameters()))
        x, y = data(BATCH)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        loss = opt.step(closure)  # the closure ran with gradients enabled, then the step
        assert isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.grad_fn is not None
        assert client.version == 1
        opt.zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        group["lr"] = 0.01
        saved = opt.state_dict()
        group["lr"] = 0.5
        opt.load_state_dict(saved)
        assert opt.param_groups[0]["lr"] == 0.01
        opt.step(closure)
        assert all(s.shard.status().learning_rate == pytest.approx(0.01) for s in shards)


def _reference(steps: int, n: int, k: int, optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer], sched):
    """One process: every step the mean gradient of the n*k micro-batches the ranks saw."""
    x, y = data(steps * n * k * BATCH)
    model = small_model()
    opt = optimizer(model)
    scheduler = sched(opt) if sched else None
    for t in range(steps):
        opt.zero_grad()
        lo = t * n * k * BATCH
        F.cross_entropy(model(x[lo : lo + n * k * BATCH]), y[lo : lo + n * k * BATCH]).backward()
        opt.step()
        if scheduler:
            scheduler.step()
    return model


def _train(addresses, n, steps, k, spec, sched=None, overlap=False, partition_bytes=None, **kw):
    x, y = data(steps * n * k * BATCH)
    models = [small_model() for _ in range(n)]

    def work(rank: int) -> torch.nn.Module:
        model = models[rank]
        extra = {"partition_bytes": partition_bytes} if partition_bytes else {}
        with PSClient(addresses, rank=rank, num_workers=n, incarnation=1, timeout=RPC_TIMEOUT, **extra) as client:
            client.init(model, spec)
            opt = DistributedOptimizer(model, client, overlap=overlap, backward_passes_per_step=k, **kw)
            scheduler = sched(opt) if sched else None
            for t in range(steps):
                opt.zero_grad()
                for j in range(k):  # micro-batches of this rank, laid out as the reference's batch
                    lo = t * n * k * BATCH + (j * n + rank) * BATCH
                    (F.cross_entropy(model(x[lo : lo + BATCH]), y[lo : lo + BATCH]) / k).backward()
                opt.step()
                if scheduler:
                    scheduler.step()
        return model

    return run_ranks(n, work)


def test_lr_scheduler_drives_sync_shards(start_cluster) -> None:
    shards = start_cluster(num_shards=2, num_workers=2)
    steps = 10

    def sched(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(3, steps))

    spec = {"name": "sgd", "lr": 0.2, "momentum": 0.9, "weight_decay": 0.01}
    models = _train([s.address for s in shards], 2, steps, 1, spec, sched)
    reference = _reference(
        steps, 2, 1, lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9, weight_decay=0.01), sched
    )
    for m in models:
        assert_close(m, reference)
    final_lr = 0.2 * warmup_cosine(3, steps)(steps - 1)  # the lr of the last step taken
    assert all(s.shard.status().learning_rate == pytest.approx(final_lr) for s in shards)


def test_sync_round_refused_when_ranks_send_different_lrs(start_cluster) -> None:
    shards = start_cluster(num_shards=1, num_workers=2)
    x, y = data(2 * BATCH)
    barrier = threading.Barrier(2, timeout=30)

    def work(rank: int) -> tuple[str, str]:
        model = small_model()
        with PSClient([shards[0].address], rank=rank, num_workers=2, incarnation=1, timeout=RPC_TIMEOUT) as client:
            client.init(model, {"name": "sgd", "lr": 0.1})
            opt = DistributedOptimizer(model, client)
            opt.param_groups[0]["lr"] = 0.1 if rank == 0 else 0.2
            F.cross_entropy(
                model(x[rank * BATCH : (rank + 1) * BATCH]), y[rank * BATCH : (rank + 1) * BATCH]
            ).backward()
            with pytest.raises(grpc.RpcError) as info:
                opt.step()
            barrier.wait()
            opt.param_groups[0]["lr"] = 0.1  # agree now: the round is pushed again and applies
            version = opt.step()
            return info.value.code().name, f"{info.value.details()}|{version}"

    results = run_ranks(2, work)
    for code, details in results:
        assert code == "FAILED_PRECONDITION"
        assert "different hyperparameters" in details and details.endswith("|1")
    assert shards[0].shard.status().version == 1
    refused = {"reason": "hyperparameters_disagree"}  # once per rank told
    assert shards[0].metrics.registry.get_sample_value("ps_rejected_pushes_total", refused) == 2


def test_async_push_carries_its_lr(start_cluster) -> None:
    shards = start_cluster(num_shards=2, num_workers=1, mode="async")
    steps = 6

    def sched(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    spec = {"name": "adam", "lr": 0.05}
    (model,) = _train([s.address for s in shards], 1, steps, 1, spec, sched)
    reference = _reference(steps, 1, 1, lambda m: torch.optim.Adam(m.parameters(), lr=0.05), sched)
    assert_close(model, reference)


@pytest.mark.parametrize("overlap", [False, True])
def test_backward_passes_per_step_pushes_the_accumulated_gradient(start_cluster, overlap: bool) -> None:
    shards = start_cluster(num_shards=2, num_workers=2)
    steps = 5
    spec = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
    # small partitions: several messages per shard, so overlap streams during backward
    models = _train([s.address for s in shards], 2, steps, 2, spec, overlap=overlap, partition_bytes=256)
    reference = _reference(steps, 2, 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), None)
    for m in models:
        assert_close(m, reference)


@pytest.mark.parametrize("overlap,k,passes", [(True, 1, 2), (False, 2, 1), (True, 2, 3)])
def test_wrong_number_of_backward_passes_is_refused(start_cluster, overlap: bool, k: int, passes: int) -> None:
    shards = start_cluster(num_shards=1, num_workers=1)
    model = small_model()
    x, y = data(BATCH)
    with PSClient([shards[0].address], rank=0, num_workers=1, timeout=RPC_TIMEOUT, partition_bytes=256) as client:
        client.init(model, {"name": "sgd", "lr": 0.1})
        opt = DistributedOptimizer(model, client, overlap=overlap, backward_passes_per_step=k)
        for _ in range(passes):
            F.cross_entropy(model(x), y).backward()
        with pytest.raises(ValueError, match="backward_passes_per_step"):
            opt.step()
        assert shards[0].shard.status().version == 0
        opt.zero_grad()
        for _ in range(k):
            F.cross_entropy(model(x), y).backward()
        assert opt.step() == 1


@pytest.mark.parametrize("unscale_first", [True, False], ids=["unscale_then_clip", "step_unscales"])
def test_grad_scaler_overflow_on_one_rank_skips_the_round_everywhere(start_cluster, unscale_first: bool) -> None:
    shards = start_cluster(num_shards=2, num_workers=2)
    steps, overflow_step = 5, 2
    x, y = data(steps * 2 * BATCH)
    models = [small_model() for _ in range(2)]

    def work(rank: int) -> tuple[torch.nn.Module, float, list[bool]]:
        model = models[rank]
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
        with PSClient(
            [s.address for s in shards], rank=rank, num_workers=2, incarnation=1, timeout=RPC_TIMEOUT
        ) as client:
            client.init(model, {"name": "sgd", "lr": 0.1, "momentum": 0.9})
            opt = DistributedOptimizer(model, client, grad_scaler=scaler)
            skipped = []
            for t in range(steps):
                opt.zero_grad()
                lo = t * 2 * BATCH + rank * BATCH
                loss = F.cross_entropy(model(x[lo : lo + BATCH]), y[lo : lo + BATCH])
                if t == overflow_step and rank == 1:
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
                if unscale_first:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)  # local clipping (never cuts here)
                scaler.step(opt)
                scaler.update()
                skipped.append(client.last_step_skipped)
        return model, scaler.get_scale(), skipped

    results = run_ranks(2, work)
    reference = small_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for t in range(steps):
        ref_opt.zero_grad()
        lo = t * 2 * BATCH
        F.cross_entropy(reference(x[lo : lo + 2 * BATCH]), y[lo : lo + 2 * BATCH]).backward()
        if t != overflow_step:
            ref_opt.step()
    for model, scale, skipped in results:
        assert skipped == [t == overflow_step for t in range(steps)]
        assert scale == 2.0**9  # both ranks backed off once, as every DDP rank does
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert (p - q).abs().max().item() <= 1e-5
    assert all(s.shard.status().version == steps for s in shards)


def test_per_group_hyperparameters_no_weight_decay_on_biases(start_cluster) -> None:
    shards = start_cluster(num_shards=2, num_workers=1)
    steps = 6
    biases = ["0.bias", "2.bias"]
    spec = {"name": "sgd", "lr": 0.1, "weight_decay": 0.1, "groups": [{"params": biases, "weight_decay": 0.0}]}

    def sched(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.9**s, lambda s: 1.0])  # per group

    def local(m: torch.nn.Module) -> torch.optim.Optimizer:
        named = dict(m.named_parameters())
        return torch.optim.SGD(
            [
                {"params": [p for k, p in named.items() if k not in biases]},
                {"params": [named[k] for k in biases], "weight_decay": 0.0},
            ],
            lr=0.1,
            weight_decay=0.1,
        )

    (model,) = _train([s.address for s in shards], 1, steps, 1, spec, sched)
    assert_close(model, _reference(steps, 1, 1, local, sched))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "amp,overlap", [(False, False), (True, False), (False, True)], ids=["fp32", "grad_scaler_overflow", "overlap"]
)
def test_equivalent_to_ddp_on_gloo(start_cluster, tmp_path: Path, amp: bool, overlap: bool) -> None:
    """The same script under DistributedDataParallel (gloo, 2 CPU ranks) and grpc-ps sync (2 workers x
    2 shards): parameters and buffers equal within 1e-5 after 50 steps, on each rank."""
    port = _free_port()
    outs = [tmp_path / f"ddp{r}.pt" for r in range(ddp_script.WORLD)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.ddp_script", str(r), str(port), str(outs[r])] + (["--amp"] * amp),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(ddp_script.WORLD)
    ]
    try:
        shards = start_cluster(num_shards=2, num_workers=ddp_script.WORLD)
        models = [ddp_script.cnn() for _ in range(ddp_script.WORLD)]

        def work(rank: int) -> tuple[torch.nn.Module, float | None, float]:
            model = models[rank]
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if amp else None
            with PSClient(
                [s.address for s in shards],
                rank=rank,
                num_workers=ddp_script.WORLD,
                incarnation=1,
                timeout=RPC_TIMEOUT,
                partition_bytes=512 if overlap else DEFAULT_PARTITION_BYTES,  # overlap: several messages stream
            ) as client:
                client.init(model, ddp_script.server_optimizer())
                opt = DistributedOptimizer(
                    model, client, backward_passes_per_step=ddp_script.K, grad_scaler=scaler, overlap=overlap
                )
                largest = ddp_script.train(rank, model, opt, scaler)
            return model, scaler.get_scale() if scaler else None, largest

        results = run_ranks(ddp_script.WORLD, work, timeout=120)
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out.decode(errors="replace")[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for rank, (model, scale, largest) in enumerate(results):
        ddp = torch.load(outs[rank], weights_only=True)
        assert set(ddp["state"]) == set(model.state_dict())  # parameters and buffers
        for key, value in model.state_dict().items():
            diff = (value.double() - ddp["state"][key].double()).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} {key}: max abs difference {diff} from DDP"
        assert scale == ddp["scale"]
        if amp:
            assert scale == 2.0**7  # one overflow (rank 1's), one back-off on every rank
        # the local clipping ran but never cut: clipping the local gradients (grpc-ps) and clipping
        # DDP's averaged gradient agree only while neither cuts (see README, "Clipping")
        assert largest < ddp_script.MAX_NORM and ddp["largest_norm"] < ddp_script.MAX_NORM


def test_bf16_autocast_works_unchanged(start_cluster) -> None:
    shards = start_cluster(num_shards=2, num_workers=1)
    steps = 4
    x, y = data(steps * BATCH)

    def run(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        for t in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x[t * BATCH : (t + 1) * BATCH]), y[t * BATCH : (t + 1) * BATCH])
            loss.backward()
            opt.step()

    model = small_model()
    with PSClient([s.address for s in shards], rank=0, num_workers=1, timeout=RPC_TIMEOUT) as client:
        client.init(model, {"name": "sgd", "lr": 0.1, "momentum": 0.9})
        run(model, DistributedOptimizer(model, client))
    reference = small_model()
    run(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9))
    assert_close(model, reference)


@pytest.mark.parametrize("mode", ["async", "ssp", "easgd"])
def test_buffers_in_the_other_modes(start_cluster, mode: str) -> None:
    """Rank 0's buffers reach the shards in async and ssp (loaded before the next forward); easgd
    averages them elastically; training with a BatchNorm model runs in every mode."""
    shards = start_cluster(num_shards=2, num_workers=1, mode=mode, communication_period=1)
    model = ddp_script.cnn()
    x, y = ddp_script.data()
    with PSClient([s.address for s in shards], rank=0, num_workers=1, timeout=RPC_TIMEOUT) as client:
        client.init(model, {"name": "sgd", "lr": 0.05})
        local = torch.optim.SGD(model.parameters(), lr=0.05) if mode == "easgd" else None
        opt = DistributedOptimizer(model, client, local_optimizer=local)
        for t in range(3):
            opt.zero_grad()
            F.cross_entropy(model(x[t * BATCH : (t + 1) * BATCH]), y[t * BATCH : (t + 1) * BATCH]).backward()
            opt.step()
        mean = model[1].running_mean.clone()
        tracked = model[1].num_batches_tracked.item()
        pulled = {k: torch.empty_like(v, dtype=torch.float64) for k, v in model.state_dict().items()}
        client.pull(pulled)
    assert tracked == 3
    if mode == "easgd":  # one worker, alpha 0.5 by default: between the start (0) and the worker's
        assert 0 < pulled["1.num_batches_tracked"].item() < 3
    else:
        assert pulled["1.num_batches_tracked"].item() == 3
        assert torch.allclose(pulled["1.running_mean"], mean.double())


@pytest.mark.parametrize(
    "hyper,match",
    [
        ([{"lr": float("nan")}], "finite number"),
        ([{"lr": 1e39}], "beyond what float32"),
        ([{"x" * 10_000: 0.1}], "not 'xxxx"),  # within the request budget: the name check answers
        ([{"nesterov": 1.0}], "not 'nesterov'"),
        ([{"lr": 0.1}, {"lr": 0.1}], "for 2 parameter groups"),
    ],
    ids=["nan", "out_of_range", "huge_key", "flag", "group_count"],
)
def test_bad_hyperparameters_are_refused_and_change_nothing(start_cluster, hyper, match: str) -> None:
    (shard,) = start_cluster(num_shards=1, num_workers=1)
    model = small_model()
    with PSClient([shard.address], rank=0, num_workers=1, timeout=RPC_TIMEOUT) as client:
        client.init(model, {"name": "sgd", "lr": 0.1})
        grads = {k: torch.ones_like(p) for k, p in model.named_parameters()}
        with pytest.raises(grpc.RpcError) as info:
            client.push_pull(grads, {k: p.data for k, p in model.named_parameters()}, hyper)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert match in info.value.details() and len(info.value.details()) < 1000
        status = shard.shard.status()
        assert status.version == 0 and status.learning_rate == 0.1
        assert client.push_pull(grads, {k: p.data for k, p in model.named_parameters()}, []) == 1


def test_overlap_with_amp_is_refused(start_cluster) -> None:
    (shard,) = start_cluster(num_shards=1, num_workers=1)
    model = small_model()
    x, y = data(BATCH)
    with PSClient([shard.address], rank=0, num_workers=1, timeout=RPC_TIMEOUT, partition_bytes=256) as client:
        client.init(model, {"name": "sgd", "lr": 0.1})
        scaler = torch.amp.GradScaler("cpu")
        with pytest.raises(ValueError, match="overlap=False with AMP"):
            DistributedOptimizer(model, client, overlap=True, grad_scaler=scaler)
        opt = DistributedOptimizer(model, client, overlap=True)  # the scaler not passed: refused at step()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        with pytest.raises(RuntimeError, match="overlap=False with AMP"):
            scaler.step(opt)
        assert shard.shard.status().version == 0
