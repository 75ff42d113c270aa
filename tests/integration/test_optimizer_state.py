"""DistributedOptimizer.state_dict() holds the shards' optimizer state in torch's layout, and
load_state_dict sends it back: a sync run saved at step N and resumed in a fresh cluster ends
bitwise as an uninterrupted one; a torch optimizer's state_dict loads; a state_dict that does not
fit is refused and changes nothing. Through real shards (2 shards, 2 workers, sync)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import torch.nn.functional as F

from ps_common.errors import PSError
from ps_worker import DistributedOptimizer, PSClient
from tests.conftest import RPC_TIMEOUT, small_model
from tests.helpers.ranks import problem
from tests.integration.test_ddp_semantics import run_ranks

N, M, WORKERS, BATCH = 3, 3, 2, 8
PARTITION_BYTES = 64  # 16 floats: every weight is cut into partitions spread over both shards
NO_DECAY = ["0.bias", "2.bias"]

ADAMW = {"name": "adamw", "lr": 0.01, "weight_decay": 0.1, "groups": [{"params": NO_DECAY, "weight_decay": 0.0}]}
ADAM = {"name": "adam", "lr": 0.01, "groups": [{"params": NO_DECAY, "lr": 0.02}]}
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "groups": [{"params": NO_DECAY, "momentum": 0.5}]}


def torch_optimizer(spec: dict[str, Any], model: torch.nn.Module) -> torch.optim.Optimizer:
    """The torch optimizer ``spec`` stands for: group 0 the weights, group 1 the biases."""
    named = dict(model.named_parameters())
    decay = [p for k, p in named.items() if k not in NO_DECAY]
    groups = [{"params": decay}, {**spec["groups"][0], "params": [named[k] for k in NO_DECAY]}]
    kwargs = {k: v for k, v in spec.items() if k not in ("name", "groups")}
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[spec["name"]]
    return cls(groups, **kwargs)


def batches(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``t``'s samples of every rank (rank r: the r-th BATCH)."""
    x, y = problem((N + M) * WORKERS * BATCH, 8, seed=11)
    lo = t * WORKERS * BATCH
    return x[lo : lo + WORKERS * BATCH], y[lo : lo + WORKERS * BATCH]


def train(
    addresses: list[str],
    spec: dict[str, Any],
    steps: range,
    weights: dict[str, torch.Tensor] | None = None,
    load: Path | None = None,
    between: Callable[[DistributedOptimizer], None] | None = None,
    handover: str = "spec",
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every rank: the model (``weights`` loaded first), init (``handover``: the dict ``spec``, or
    "torch": the torch optimizer it stands for, as a ported script passes it), the optimizer state
    of ``load``, then ``steps``; returns rank 0's weights and optimizer state_dict."""

    models = [small_model() for _ in range(WORKERS)]  # before the threads: small_model seeds the global RNG

    def work(rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        model = models[rank]
        if weights is not None:
            model.load_state_dict(weights)
        extra = {"partition_bytes": PARTITION_BYTES}
        with PSClient(addresses, rank=rank, num_workers=WORKERS, incarnation=1, timeout=RPC_TIMEOUT, **extra) as client:
            if handover == "torch":
                own = torch_optimizer(spec, model)
                client.init(model, own)
                opt = DistributedOptimizer(model, client, own)
            else:
                client.init(model, spec)
                opt = DistributedOptimizer(model, client)
            if load is not None:
                opt.load_state_dict(torch.load(load, weights_only=True))
            for t in steps:
                x, y = batches(t)
                opt.zero_grad()
                F.cross_entropy(
                    model(x[rank * BATCH : (rank + 1) * BATCH]), y[rank * BATCH : (rank + 1) * BATCH]
                ).backward()
                opt.step()
            if between is not None and rank == 0:
                between(opt)
            return copy.deepcopy(model.state_dict()), opt.state_dict()

    return run_ranks(WORKERS, work)[0]


def reference(spec: dict[str, Any], steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """One process, torch's optimizer, each step the ranks' mean gradient as the shards take it
    ((g0 + g1) / 2, in rank order)."""
    model = small_model()
    opt = torch_optimizer(spec, model)
    for t in range(steps):
        reference_step(model, opt, t)
    return model, opt


def reference_step(model: torch.nn.Module, opt: torch.optim.Optimizer, t: int) -> None:
    x, y = batches(t)
    grads = []
    for r in range(WORKERS):
        model.zero_grad()
        F.cross_entropy(model(x[r * BATCH : (r + 1) * BATCH]), y[r * BATCH : (r + 1) * BATCH]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for p, g0, g1 in zip(model.parameters(), *grads, strict=True):
        p.grad = torch.add(g0, g1).div_(WORKERS)
    opt.step()


def assert_state_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Same parameter numbers, names, dtypes, shapes and bits."""
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys(), f"parameter {i}: {sorted(a[i])} vs {sorted(b[i])}"
        for name, v in a[i].items():
            w = b[i][name]
            assert v.dtype == w.dtype and v.shape == w.shape, f"{i}.{name}: {v.dtype}{v.shape} vs {w.dtype}{w.shape}"
            assert torch.equal(v, w), f"{i}.{name} differs"


def assert_weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def fresh(start_cluster) -> list[str]:
    return start_cluster(num_shards=2, num_workers=WORKERS).addresses


def stop(start_cluster) -> None:
    start_cluster.stop_all()


@pytest.mark.parametrize("handover", ["spec", "torch"])
@pytest.mark.parametrize("spec", [ADAMW, SGD], ids=["adamw", "sgd-momentum"])
def test_resume_in_a_fresh_cluster_is_bitwise_an_uninterrupted_run(
    start_cluster, tmp_path: Path, spec, handover: str
) -> None:
    whole_weights, whole_state = train(fresh(start_cluster), spec, range(N + M), handover=handover)
    stop(start_cluster)

    weights, state = train(fresh(start_cluster), spec, range(N), handover=handover)
    stop(start_cluster)
    names = {"adamw": {"step", "exp_avg", "exp_avg_sq"}, "sgd": {"momentum_buffer"}}[spec["name"]]
    assert len(state["state"]) == 4 and all(set(s) == names for s in state["state"].values())
    assert [g["params"] for g in state["param_groups"]] == [[0, 1], [2, 3]]
    torch.save(weights, tmp_path / "model.pt")
    torch.save(state, tmp_path / "opt.pt")

    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    resumed_weights, resumed_state = train(
        fresh(start_cluster), spec, range(N, N + M), weights, tmp_path / "opt.pt", handover=handover
    )
    assert_weights_equal(resumed_weights, whole_weights)
    assert_state_equal(resumed_state["state"], whole_state["state"])


@pytest.mark.parametrize("spec", [ADAMW, SGD], ids=["adamw", "sgd-momentum"])
def test_state_dict_is_torch_optimizer_state_dict(start_cluster, spec) -> None:
    weights, state = train(fresh(start_cluster), spec, range(N))
    model, opt = reference(spec, N)
    assert_weights_equal(weights, model.state_dict())
    ref = opt.state_dict()
    assert_state_equal(state["state"], ref["state"])
    assert [g["params"] for g in state["param_groups"]] == [g["params"] for g in ref["param_groups"]]


def test_torch_adam_state_dict_continues_that_run(start_cluster, tmp_path: Path) -> None:
    model, opt = reference(ADAM, N)
    torch.save(opt.state_dict(), tmp_path / "adam.pt")
    weights = copy.deepcopy(model.state_dict())
    for t in range(N, N + M):
        reference_step(model, opt, t)
    resumed, state = train(fresh(start_cluster), ADAM, range(N, N + M), weights, tmp_path / "adam.pt")
    assert_weights_equal(resumed, model.state_dict())
    assert_state_equal(state["state"], opt.state_dict()["state"])
    assert state["param_groups"][1]["lr"] == 0.02


def refusals(opt: DistributedOptimizer) -> None:
    """Every unfitting state_dict is refused and the shards' state stays as it was."""
    before = opt.state_dict()
    good = copy.deepcopy(before)
    del good["ps"]

    def refused(sd: dict[str, Any], error: type[BaseException], match: str) -> None:
        with pytest.raises(error, match=match) as info:
            opt.load_state_dict(sd)
        if isinstance(info.value, PSError):
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert_state_equal(opt.state_dict()["state"], before["state"])
        assert opt.param_groups[1]["lr"] == before["param_groups"][1]["lr"]

    shape = copy.deepcopy(good)
    shape["state"][0]["exp_avg"] = shape["state"][0]["exp_avg"].t().contiguous()
    refused(shape, ValueError, "shape")
    groups = copy.deepcopy(good)
    groups["param_groups"] = [{**groups["param_groups"][0], "params": [0, 1, 2, 3]}]
    refused(groups, ValueError, "parameter groups")
    model = small_model()
    sgd = torch_optimizer(SGD, model)  # the same groups and shapes, SGD's state names
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    sgd.step()
    refused(sgd.state_dict(), PSError, "keeps")
    partial = copy.deepcopy(good)  # one shard accepts, one refuses: neither applies
    partial["state"][3]["bogus"] = torch.zeros(3)
    partial["state"][0]["exp_avg"].add_(1.0)
    refused(partial, PSError, "bogus")
    missing = copy.deepcopy(good)
    del missing["state"][1]["exp_avg_sq"]
    refused(missing, PSError, "exp_avg_sq")
    opt.load_state_dict(before)  # the state itself loads again, changing nothing
    assert_state_equal(opt.state_dict()["state"], before["state"])


def test_unfitting_state_dicts_are_refused_and_change_nothing(start_cluster) -> None:
    train(fresh(start_cluster), ADAMW, range(2), between=refusals)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_one_rank_in_other_modes_keeps_torch_state(start_cluster, tmp_path: Path, mode: str) -> None:
    """async and ssp: one rank's pushes are torch's steps; its state_dict is torch's, and it loads."""
    shards = start_cluster(num_shards=2, num_workers=1, mode=mode)
    x, y = batches(0)
    model = small_model()
    ref_model = small_model()
    ref = torch_optimizer(ADAMW, ref_model)
    with PSClient(shards.addresses, rank=0, num_workers=1, timeout=RPC_TIMEOUT, partition_bytes=PARTITION_BYTES) as c:
        c.init(model, ADAMW)
        opt = DistributedOptimizer(model, c)
        for m, o in ((model, opt), (ref_model, ref)):
            for _ in range(2):
                o.zero_grad()
                F.cross_entropy(m(x), y).backward()
                o.step()
        saved = opt.state_dict()
        assert_state_equal(saved["state"], ref.state_dict()["state"])
        opt.load_state_dict(saved)
        assert_state_equal(opt.state_dict()["state"], saved["state"])
