"""diloco with ``--fragments F`` over real gRPC shards against a single-process reference of Streaming
DiLoCo written from the paper's pseudo-code (Douillard et al. 2025, arXiv:2501.18512, Algorithm 1
without overlap, mixing alpha = 0): every H/F inner steps one fragment (each parameter, in order,
joins the fragment with the fewest bytes so far; round t carries fragment t mod F) is averaged,
stepped by the outer optimizer alone, and replaces each worker's local copy of it."""

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
from tests.integration.test_diloco import DILOCO_OUTER, INITIAL, batches, diloco_cluster, make_model, train


def bf16_model() -> torch.nn.Module:
    """The test model with values a bfloat16 wire carries exactly (rank 1 pulls its initial values)."""
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def fragment_of(model: torch.nn.Module, fragments: int) -> list[int]:
    """Each parameter's fragment: in order, the one with the fewest bytes so far (ties: lowest)."""
    loads, out = [0] * fragments, []
    for p in model.parameters():
        out.append(loads.index(min(loads)))
        loads[out[-1]] += p.numel() * 4
    return out


def streaming_reference(
    data: list[list[tuple[torch.Tensor, torch.Tensor]]],
    period: int,
    fragments: int | Callable[[int], int],
    wire: torch.dtype | None = None,
    weights: tuple[float, float] = (0.5, 0.5),
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[list[torch.Tensor]]]:
    """Streaming DiLoCo in one process: each worker takes inner AdamW steps on its own replica;
    every H // F inner steps (F in force at the round: ``fragments(t)``), outer round t syncs fragment p = t mod F:
    delta_p = mean over workers of (anchor_p - theta_local_p) (each rounded to ``wire`` as it
    travels), the outer Nesterov SGD steps theta_p alone (the others have no grad), and every worker
    sets theta_local_p = anchor_p = theta_p (as ``wire`` carries it back). ``weights``: each
    worker's share of the mean (FedAvg: its samples since p's last sync over all workers').
    Returns theta, the outer optimizer's momentum per parameter (None: never stepped), and each
    worker's parameters."""
    model = bf16_model() if wire is not None else make_model()
    theta = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    outer = torch.optim.SGD(theta, **{k: v for k, v in DILOCO_OUTER.items() if k != "name"})
    replicas = [copy.deepcopy(model) for _ in data]
    anchors = [[p.detach().clone() for p in model.parameters()] for _ in data]
    inners = [torch.optim.AdamW(r.parameters(), lr=0.01) for r in replicas]
    carry = (lambda t: t.to(wire).float()) if wire is not None else (lambda t: t)
    fragments_at = fragments if callable(fragments) else lambda t: fragments
    t = in_round = 0
    for step in range(len(data[0])):
        for i, replica in enumerate(replicas):
            x, y = data[i][step]
            inners[i].zero_grad()
            F.mse_loss(replica(x), y).backward()
            inners[i].step()
        in_round, count = in_round + 1, fragments_at(t)
        if in_round < period // count:
            continue
        in_round, p = 0, t % count
        t += 1
        mine = [j for j, f in enumerate(fragment_of(model, count)) if f == p]
        for j, th in enumerate(theta):
            deltas = [carry(a[j] - list(r.parameters())[j].detach()) for a, r in zip(anchors, replicas, strict=True)]
            th.grad = deltas[0] * weights[0] + deltas[1] * weights[1] if j in mine else None
        outer.step()
        with torch.no_grad():
            for a, r in zip(anchors, replicas, strict=True):
                for j in mine:
                    list(r.parameters())[j].copy_(carry(theta[j].detach()))
                    a[j].copy_(carry(theta[j].detach()))
    momentum = [outer.state.get(th, {}).get("momentum_buffer") for th in theta]
    return [th.detach() for th in theta], momentum, [[p.detach() for p in r.parameters()] for r in replicas]


def train_on(addresses, data, fragments_model, **client_args) -> list[list[torch.Tensor]]:
    """Each rank in a thread with inner AdamW (``fragments_model`` makes the model); its parameters at the end."""
    out: list[list[torch.Tensor]] = [[] for _ in data]
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            model = fragments_model()
            with PSClient(addresses, rank=rank, num_workers=2, incarnation=1, timeout=RPC_TIMEOUT, **client_args) as c:
                c.init(model, {"name": "sgd", "lr": 0.1})
                opt = DistributedOptimizer(model, c, torch.optim.AdamW(model.parameters(), lr=0.01))
                for x, y in data[rank]:
                    opt.zero_grad()
                    F.mse_loss(model(x), y).backward()
                    opt.step()
                out[rank] = [p.detach().clone() for p in model.parameters()]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    return out


def shard_values(shards, momentum: bool = False) -> dict[str, torch.Tensor]:
    """theta (or the outer optimizer's momentum) on the shards, key -> flat tensor (from partitions)."""
    flat = {k: torch.zeros(p.numel()) for k, p in INITIAL.named_parameters()}
    for s in shards:
        store = s.shard.store
        for part, t in zip(store.partitions, store.tensors, strict=True):
            value = store.optimizer.state.get(t, {}).get("momentum_buffer") if momentum else t
            if value is not None:
                flat[part.key][part.offset : part.offset + part.length] = value
    return flat


def check(shards, got, want) -> None:
    theta, momentum, replicas = want
    on_shards, moms = shard_values(shards), shard_values(shards, momentum=True)
    for (key, _), th, m in zip(INITIAL.named_parameters(), theta, momentum, strict=True):
        torch.testing.assert_close(on_shards[key], th.reshape(-1), rtol=0, atol=1e-6)
        torch.testing.assert_close(moms[key], m.reshape(-1), rtol=0, atol=1e-6)
    for rank_params, replica in zip(got, replicas, strict=True):
        for g, w in zip(rank_params, replica, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fragments", [2, 3])
def test_streaming_diloco_equals_the_reference_with_one_fragment_per_round(start_cluster, fragments) -> None:
    period, cycles = 6, 2
    rounds = fragments * cycles
    shards = diloco_cluster(start_cluster, period, fragments=fragments)
    data = [batches(r, period * cycles, 16) for r in range(2)]
    metrics = [WorkerMetrics(CollectorRegistry()) for _ in range(2)]
    got = train([s.address for s in shards], data, "adamw", count=False, metrics=metrics)
    want = streaming_reference(data, period, fragments)
    check(shards, got, want)
    plain, _, _ = streaming_reference(data, period, 1)
    assert max(float((w - q).abs().max()) for w, q in zip(want[0], plain, strict=True)) > 1e-3  # fragments matter
    assert all(s.shard.version == rounds for s in shards)  # a version per fragment round
    for m in metrics:
        assert m.registry.get_sample_value("ps_worker_outer_rounds_total") == rounds


def wide_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32))


def test_fragment_rounds_weight_each_rank_by_its_samples_since_the_fragments_last_sync(start_cluster) -> None:
    period = 6
    shards = diloco_cluster(start_cluster, period, fragments=3)
    data = [batches(0, period * 2, 8), batches(1, period * 2, 24)]  # 1 : 3 samples
    got = train([s.address for s in shards], data, "adamw", count=True)
    check(shards, got, streaming_reference(data, period, 3, weights=(0.25, 0.75)))


def test_a_fragment_round_moves_one_fth_of_the_bytes(start_cluster) -> None:
    """Bytes per outer round (ps_worker_outer_round_bytes: delta out, theta in) with F=2 against F=1."""
    per_round = {}
    for fragments in (1, 2):
        shards = diloco_cluster(start_cluster, 2, num_shards=2, num_workers=1, fragments=fragments)
        metrics = WorkerMetrics(CollectorRegistry())
        model = wide_model()
        with PSClient([s.address for s in shards], rank=0, num_workers=1, incarnation=1, metrics=metrics) as c:
            c.init(model, {"name": "sgd", "lr": 0.1})
            opt = DistributedOptimizer(model, c, torch.optim.SGD(model.parameters(), lr=0.01))
            for _ in range(4):
                opt.zero_grad()
                model(torch.ones(2, 4)).square().mean().backward()
                opt.step()
        value = metrics.registry.get_sample_value
        per_round[fragments] = value("ps_worker_outer_round_bytes_sum") / value("ps_worker_outer_round_bytes_count")
    assert 2 * 4 * 4768 < per_round[1] < 2 * 4 * 4768 * 1.05  # 4768 float32 parameters each way
    assert 0.45 < per_round[2] / per_round[1] < 0.55, per_round


@pytest.mark.parametrize("fragments", [1, 2])
def test_rounds_with_bf16_deltas_equal_the_reference_rounding_them_the_same_way(start_cluster, fragments) -> None:
    period = 6
    shards = diloco_cluster(start_cluster, period, fragments=fragments)
    data = [batches(r, period * 2, 16) for r in range(2)]
    got = train_on([s.address for s in shards], data, bf16_model, wire_dtype="bfloat16")
    check(shards, got, streaming_reference(data, period, fragments, wire=torch.bfloat16))


@pytest.mark.parametrize("partition_bytes", [16, 1 << 20])
def test_fragment_rounds_on_data_connections_equal_the_reference(start_cluster, partition_bytes) -> None:
    """The partitions go on the ranks' data connections: as frames (16-byte partitions: several
    messages a shard) or as one PushPullOnce call; the shards answer the fragment's alone."""
    period = 6
    shards = diloco_cluster(start_cluster, period, fragments=3, data_port=0)
    data = [batches(r, period * 2, 16) for r in range(2)]
    got = train_on([s.address for s in shards], data, make_model, partition_bytes=partition_bytes)
    check(shards, got, streaming_reference(data, period, 3))


def test_a_shard_restart_between_fragment_rounds_changes_nothing(tmp_path, start_cluster) -> None:
    """Both shards stop after round 3 (final checkpoint: theta and each fragment's Nesterov momentum)
    and come back on their ports; the ranks rejoin and the run ends where an uninterrupted one does."""
    period, fragments = 6, 2
    shards = diloco_cluster(start_cluster, period, fragments=fragments, checkpoint_dir=str(tmp_path))
    data = [batches(r, period * 2, 16) for r in range(2)]
    paused, resumed = threading.Barrier(3, timeout=60), threading.Barrier(3, timeout=60)

    def after_step(step: int, opt: DistributedOptimizer) -> None:
        if step == 3 * (period // fragments) - 1:  # round 3 (fragment 0 again) done on this rank
            paused.wait()
            resumed.wait()

    results: list[list[list[torch.Tensor]]] = []
    runner = threading.Thread(
        target=lambda: results.append(train([s.address for s in shards], data, "adamw", False, after_step))
    )
    runner.start()
    paused.wait()
    for s in shards:
        s.stop(grace=0.5)  # writes a final checkpoint at version 3
    restarted = [start_cluster.restart(s, same_port=True) for s in shards]
    assert all(s.shard.status().restored_from_version == 3 for s in restarted)
    resumed.wait()
    runner.join(timeout=120)
    assert not runner.is_alive() and results
    check(restarted, results[0], streaming_reference(data, period, fragments))
    assert all(s.shard.version == 4 for s in restarted)


def test_bad_fragments_are_refused_and_change_nothing(start_cluster) -> None:
    with pytest.raises(Exception, match="--fragments 4 is more than --communication-period 3"):
        diloco_cluster(start_cluster, 3, fragments=4)
    shards = diloco_cluster(start_cluster, 6, num_shards=1, num_workers=1, fragments=5)  # the model has 4
    model = make_model()
    with PSClient([shards[0].address], rank=0, num_workers=1, incarnation=1, timeout=RPC_TIMEOUT) as c:
        with pytest.raises(grpc.RpcError) as info:
            c.init(model, {"name": "sgd", "lr": 0.1})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "more than the model's 4 parameters" in info.value.details()  # type: ignore[attr-defined]
    assert shards[0].shard.store is None
    with grpc.insecure_channel(shards[0].address) as ch:
        admin = ps_pb2_grpc.AdminStub(ch)
        assert admin.GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT).status.config.fragments == 5
        with pytest.raises(grpc.RpcError) as info:  # H below F
            admin.UpdateConfig(ps_pb2.UpdateConfigRequest(communication_period=4), timeout=RPC_TIMEOUT)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert admin.GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT).status.config.communication_period == 6


def test_a_push_of_another_fragments_partitions_is_refused(start_cluster) -> None:
    """Round 0 carries fragment 0 (0.weight, 2.weight); a whole-model push is refused, nothing moves."""
    shards = diloco_cluster(start_cluster, 6, num_shards=1, num_workers=1, fragments=2)
    model = make_model()
    with PSClient([shards[0].address], rank=0, num_workers=1, incarnation=1, timeout=RPC_TIMEOUT) as c:
        c.init(model, json.loads(json.dumps(DILOCO_OUTER)))
        with grpc.insecure_channel(shards[0].address) as ch, pytest.raises(grpc.RpcError) as refused:
            ps_pb2_grpc.AdminStub(ch).UpdateConfig(ps_pb2.UpdateConfigRequest(fragments=5), timeout=RPC_TIMEOUT)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # the model has 4 parameters
        assert shards[0].shard.settings.fragments == 2
        before = [t.clone() for t in shards[0].shard.store.tensors]
        grads = {k: torch.ones_like(p) for k, p in model.named_parameters()}
        with pytest.raises(grpc.RpcError) as info:
            c.push_pull(grads, {k: p.data for k, p in model.named_parameters()}, hyperparameters=[])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "not in the fragment" in info.value.details()  # type: ignore[attr-defined]
    assert shards[0].shard.version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, shards[0].shard.store.tensors, strict=True))


def test_local_steps_state_dict_keeps_the_position_in_the_sub_period(start_cluster) -> None:
    shards = diloco_cluster(start_cluster, 4, num_shards=1, num_workers=1, fragments=2)
    model = make_model()
    with PSClient([shards[0].address], rank=0, num_workers=1, incarnation=1, timeout=RPC_TIMEOUT) as c:
        c.init(model, {"name": "sgd", "lr": 0.1})
        opt = DistributedOptimizer(model, c, torch.optim.SGD(model.parameters(), lr=0.05))
        for x, y in batches(0, 3, 4):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.count_samples(len(x))
            opt.step()
        state = opt.state_dict()["ps"]
    assert c.version == 1  # round 0 (fragment 0) after H/F = 2 steps
    assert state["steps_in_round"] == 1 and state["fragment_samples"] == [4, 12]


def test_a_live_change_of_f_applies_from_the_outer_round_it_is_scheduled_at(start_cluster) -> None:
    """ps-admin set --fragments 3 --at-version 2 on H = 6: rounds 0, 1 carry everything after 6
    steps each, then a round every 2 steps carries fragment t mod 3."""
    shards = diloco_cluster(start_cluster, 6)
    with grpc.insecure_channel(shards[0].address) as ch:
        ps_pb2_grpc.AdminStub(ch).UpdateConfig(
            ps_pb2.UpdateConfigRequest(fragments=3, at_version=2), timeout=RPC_TIMEOUT
        )
    data = [batches(r, 18, 16) for r in range(2)]
    got = train([s.address for s in shards], data, "adamw", count=False)
    check(shards, got, streaming_reference(data, 6, lambda t: 1 if t < 2 else 3))
    assert [s.shard.version for s in shards] == [5, 5]
