"""diloco over real gRPC shards against single-process references written from the papers' pseudo-code:
DiLoCo (Douillard et al. 2023, arXiv:2311.08105, Algorithm 1: inner AdamW, outer SGD with Nesterov
momentum) and FedAvg (McMahan et al. 2017, Algorithm 1: ``w <- sum_k n_k / n * w_k``) with
unequal sample counts."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable

import grpc
import pytest
import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry

from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_worker import DistributedOptimizer, PSClient
from ps_worker.metrics import WorkerMetrics
from tests.conftest import RPC_TIMEOUT

DILOCO_OUTER = {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}
FEDAVG_OUTER = {"name": "sgd", "lr": 1.0}


torch.manual_seed(0)
INITIAL = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
"""Built once: ranks run in threads, where seeding the global generator would race."""


def make_model() -> torch.nn.Module:
    return copy.deepcopy(INITIAL)


def batches(rank: int, steps: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s ``steps`` batches of ``size`` samples (a fixed regression target)."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        x = torch.randn(size, 4, generator=g)
        out.append((x, (x @ torch.tensor([[1.5], [-2.0], [0.5], [3.0]])).sin()))
    return out


def inner_optimizer(name: str, params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01) if name == "adamw" else torch.optim.SGD(params, lr=0.05)


def reference(
    data: list[list[tuple[torch.Tensor, torch.Tensor]]], period: int, inner: str, outer: dict, weighted: bool
) -> list[torch.Tensor]:
    """Algorithm 1 of DiLoCo, one process: every worker starts each outer round from theta, takes
    ``period`` inner steps with its own inner optimizer (its state kept across rounds), the outer
    gradient is the (FedAvg: sample-weighted) average of theta - theta_i, and the outer optimizer steps theta."""
    model = make_model()
    theta = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    kwargs = {k: v for k, v in outer.items() if k != "name"}
    outer_opt = torch.optim.SGD(theta, **kwargs)
    replicas = [copy.deepcopy(model) for _ in data]
    inners = [inner_optimizer(inner, r.parameters()) for r in replicas]
    rounds = len(data[0]) // period
    for t in range(rounds):
        deltas, counts = [], []
        for i, replica in enumerate(replicas):
            with torch.no_grad():
                for p, th in zip(replica.parameters(), theta, strict=True):
                    p.copy_(th)
            n = 0
            for x, y in data[i][t * period : (t + 1) * period]:
                inners[i].zero_grad()
                F.mse_loss(replica(x), y).backward()
                inners[i].step()
                n += len(x)
            deltas.append([th.detach() - p.detach() for th, p in zip(theta, replica.parameters(), strict=True)])
            counts.append(n)
        weights = [n / sum(counts) for n in counts] if weighted else [1 / len(data)] * len(data)
        for j, th in enumerate(theta):
            th.grad = sum(w * d[j] for w, d in zip(weights, deltas, strict=True))
        outer_opt.step()
    return [th.detach() for th in theta]


def train(
    addresses: list[str],
    data: list[list[tuple[torch.Tensor, torch.Tensor]]],
    inner: str,
    count: bool | Callable[[int, torch.Tensor], int],
    after_step: Callable[[int, DistributedOptimizer], None] | None = None,
    metrics: list[WorkerMetrics] | None = None,
) -> list[list[torch.Tensor]]:
    """Every rank in a thread: ``DistributedOptimizer`` around the inner optimizer; returns each rank's
    parameters after its last step (an outer round's result). ``count``: each rank counts its batches'
    samples (``count(rank, x)`` of them when it is a function)."""
    out: list[list[torch.Tensor]] = [[] for _ in data]
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            model = make_model()
            m = metrics[rank] if metrics else None
            with PSClient(
                addresses, rank=rank, num_workers=len(data), incarnation=1, timeout=RPC_TIMEOUT, metrics=m
            ) as c:
                c.init(model, inner_optimizer(inner, model.parameters()))
                opt = DistributedOptimizer(model, c, inner_optimizer(inner, model.parameters()))
                for step, (x, y) in enumerate(data[rank]):
                    opt.zero_grad()
                    F.mse_loss(model(x), y).backward()
                    if count:
                        opt.count_samples(len(x) if count is True else count(rank, x))
                    opt.step()
                    if after_step is not None:
                        after_step(step, opt)
                out[rank] = [p.detach().clone() for p in model.parameters()]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(data))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not errors, errors
    return out


def diloco_cluster(start_cluster, period: int, outer: dict = DILOCO_OUTER, **config):
    """A diloco cluster of 2 shards and 2 workers unless ``config`` says otherwise."""
    config = {"num_shards": 2, "num_workers": 2, **config}
    return start_cluster(mode="diloco", communication_period=period, outer_optimizer=json.dumps(outer), **config)


def test_diloco_equals_algorithm_1_with_inner_adamw_and_outer_nesterov(start_cluster) -> None:
    period, rounds = 5, 4
    shards = diloco_cluster(start_cluster, period)
    data = [batches(r, period * rounds, 16) for r in range(2)]
    metrics = [WorkerMetrics(CollectorRegistry()) for _ in range(2)]
    got = train([s.address for s in shards], data, "adamw", count=False, metrics=metrics)
    want = reference(data, period, "adamw", DILOCO_OUTER, weighted=False)
    for rank_params in got:  # every rank holds theta after the last outer round
        for g, w in zip(rank_params, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    moved = max(float((w - p.detach()).abs().max()) for w, p in zip(want, make_model().parameters(), strict=True))
    assert moved > 0.05  # the reference trained: equality is not two untouched models
    for s in shards:
        assert s.shard.version == rounds  # one version per outer round, not per inner step
    for m in metrics:
        value = m.registry.get_sample_value
        assert value("ps_worker_local_steps_total") == period * rounds
        assert value("ps_worker_outer_rounds_total") == rounds
        assert value("ps_worker_outer_round_bytes_count") == rounds
        per_round = value("ps_worker_outer_round_bytes_sum") / rounds
        assert per_round > 2 * 4 * sum(p.numel() for p in INITIAL.parameters())  # Δ out, theta in, float32


def test_fedavg_weights_each_rank_by_its_sample_count(start_cluster) -> None:
    period, rounds = 4, 3
    shards = diloco_cluster(start_cluster, period, FEDAVG_OUTER)
    data = [batches(0, period * rounds, 8), batches(1, period * rounds, 24)]  # 1 : 3 samples
    got = train([s.address for s in shards], data, "sgd", count=True)
    want = reference(data, period, "sgd", FEDAVG_OUTER, weighted=True)
    unweighted = reference(data, period, "sgd", FEDAVG_OUTER, weighted=False)
    for g, w in zip(got[0], want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    assert max(float((w - u).abs().max()) for w, u in zip(want, unweighted, strict=True)) > 1e-3  # weights matter


def test_a_rank_that_counts_0_samples_weighs_nothing(start_cluster) -> None:
    """count_samples(0) is a count, not "not counting": rank 1's outer gradients weigh 0, so FedAvg's
    theta_global is rank 0's alone, as one worker training rank 0's data would make it."""
    period, rounds = 3, 3
    shards = diloco_cluster(start_cluster, period, FEDAVG_OUTER)
    data = [batches(0, period * rounds, 8), batches(1, period * rounds, 8)]
    got = train([s.address for s in shards], data, "sgd", count=lambda rank, x: len(x) if rank == 0 else 0)
    want = reference(data[:1], period, "sgd", FEDAVG_OUTER, weighted=False)
    for a, b, w in zip(got[0], got[1], want, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, w, rtol=0, atol=1e-6)
    both = reference(data, period, "sgd", FEDAVG_OUTER, weighted=False)
    assert max(float((w - u).abs().max()) for w, u in zip(want, both, strict=True)) > 1e-3  # rank 1 would move it


def test_a_round_where_only_some_ranks_count_samples_is_refused_whole(start_cluster) -> None:
    shards = diloco_cluster(start_cluster, 2, num_shards=1)
    data = [batches(r, 2, 8) for r in range(2)]
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            m = make_model()
            with PSClient([shards[0].address], rank=rank, num_workers=2, incarnation=1, timeout=RPC_TIMEOUT) as c:
                c.init(m, {"name": "sgd", "lr": 0.1})
                opt = DistributedOptimizer(m, c, torch.optim.SGD(m.parameters(), lr=0.05))
                for x, y in data[rank]:
                    opt.zero_grad()
                    F.mse_loss(m(x), y).backward()
                    if rank == 0:
                        opt.count_samples(len(x))
                    opt.step()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 2 and all(isinstance(e, grpc.RpcError) for e in errors), errors
    assert {e.code() for e in errors} == {grpc.StatusCode.FAILED_PRECONDITION}  # type: ignore[attr-defined]
    assert "count_samples" in str(errors[0])
    store = shards[0].shard.store
    assert shards[0].shard.version == 0
    flat = torch.cat([p.reshape(-1) for p in before])
    assert torch.equal(torch.cat([t.reshape(-1) for t in store.tensors])[: flat.numel()], flat)  # unchanged


def test_a_diloco_cluster_reports_its_mode_and_refuses_a_live_switch(start_cluster) -> None:
    shards = diloco_cluster(start_cluster, 3, num_shards=1, num_workers=1)
    with grpc.insecure_channel(shards[0].address) as ch:
        admin = ps_pb2_grpc.AdminStub(ch)
        status = admin.GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT).status
        assert status.config.mode == ps_pb2.MODE_DILOCO
        assert status.config.communication_period == 3
        assert json.loads(status.config.outer_optimizer) == DILOCO_OUTER
        with pytest.raises(grpc.RpcError) as info:
            admin.UpdateConfig(ps_pb2.UpdateConfigRequest(mode=ps_pb2.MODE_SYNC), timeout=RPC_TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "restart the cluster" in info.value.details()


def test_a_shard_restart_between_outer_rounds_changes_nothing(tmp_path, start_cluster) -> None:
    """Both shards stop after round 2 (final checkpoint: theta and the outer optimizer's Nesterov
    momentum) and come back on their ports; the ranks, still in their inner loops, rejoin and the
    run ends where an uninterrupted one does."""
    period, rounds = 5, 4
    shards = diloco_cluster(start_cluster, period, checkpoint_dir=str(tmp_path))
    data = [batches(r, period * rounds, 16) for r in range(2)]
    paused, resumed = threading.Barrier(3, timeout=60), threading.Barrier(3, timeout=60)

    def after_step(step: int, opt: DistributedOptimizer) -> None:
        if step == 2 * period - 1:  # round 2 done on this rank
            paused.wait()
            resumed.wait()

    results: list[list[list[torch.Tensor]]] = []
    runner = threading.Thread(
        target=lambda: results.append(train([s.address for s in shards], data, "adamw", False, after_step))
    )
    runner.start()
    paused.wait()
    for s in shards:
        s.stop(grace=0.5)  # writes a final checkpoint at version 2
    restarted = [start_cluster.restart(s, same_port=True) for s in shards]
    assert all(s.shard.status().restored_from_version == 2 for s in restarted)
    resumed.wait()
    runner.join(timeout=120)
    assert not runner.is_alive() and results
    want = reference(data, period, "adamw", DILOCO_OUTER, weighted=False)
    for g, w in zip(results[0][0], want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    assert all(s.shard.version == rounds for s in restarted)


def test_a_shard_restarted_empty_mid_round_gets_theta_global_and_loses_no_round(start_cluster) -> None:
    """Shard 1 (no checkpoint) stops two inner steps into round 3 and comes back empty: rank 0
    writes it theta_global of version 2 (not its local parameters, two inner steps on) at version 2,
    the ranks push round 2 to it, and with FedAvg's momentum-free outer SGD the run ends exactly
    where an uninterrupted one does (before, it came back at version 0 with rank 0's local values)."""
    period, rounds = 4, 4
    shards = diloco_cluster(start_cluster, period, FEDAVG_OUTER)
    data = [batches(r, period * rounds, 16) for r in range(2)]
    paused, resumed = threading.Barrier(3, timeout=60), threading.Barrier(3, timeout=60)

    def after_step(step: int, opt: DistributedOptimizer) -> None:
        if step == 2 * period + 1:  # two inner steps into round 3 (version 2)
            paused.wait()
            resumed.wait()

    results: list[list[list[torch.Tensor]]] = []
    runner = threading.Thread(
        target=lambda: results.append(train([s.address for s in shards], data, "sgd", False, after_step))
    )
    runner.start()
    paused.wait()
    shards[1].stop(grace=0.5)  # no checkpoint directory: its state is gone
    restarted = start_cluster.restart(shards[1], same_port=True)
    assert restarted.shard.status().initialized is False
    resumed.wait()
    runner.join(timeout=120)
    assert not runner.is_alive() and results
    want = reference(data, period, "sgd", FEDAVG_OUTER, weighted=False)
    for a, b, w in zip(results[0][0], results[0][1], want, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, w, rtol=0, atol=1e-6)
    assert shards[0].shard.version == restarted.shard.version == rounds


def test_a_live_change_of_h_applies_from_the_outer_round_it_is_scheduled_at(start_cluster) -> None:
    shards = diloco_cluster(start_cluster, 5)
    with grpc.insecure_channel(shards[0].address) as ch:  # ps-admin set --communication-period 2 --at-version 2
        ps_pb2_grpc.AdminStub(ch).UpdateConfig(
            ps_pb2.UpdateConfigRequest(communication_period=2, at_version=2), timeout=RPC_TIMEOUT
        )
    data = [batches(r, 16, 8) for r in range(2)]
    got = train([s.address for s in shards], data, "sgd", count=False)
    # rounds 0 and 1 after 5 inner steps each, then 2, 3, 4 after 2 each: 16 steps, version 5
    assert [s.shard.version for s in shards] == [5, 5]
    for a, b in zip(got[0], got[1], strict=True):
        assert torch.equal(a, b)  # both ranks closed every round together and hold theta_global
