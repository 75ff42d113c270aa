"""How a shard's state changes under hostile or unlucky requests.

An update is all or nothing: a learning rate out of the parameters' range is refused, a failing
optimizer step or an update that would make parameters non-finite is refused as a whole (ABORTED,
the reason named) and leaves parameters, optimizer state and version as they were; a replayed
(rank, incarnation, clock) is never applied twice, across restarts; a shard's own pause never
evicts its workers. Real shards over real gRPC, every call and wait bounded.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_worker import PSClient
from ps_worker.client import reason_of
from tests.conftest import RPC_TIMEOUT

ROOT = Path(__file__).resolve().parents[2]


def model(fill: float | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    if fill is not None:
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(fill)
    return m


def grads(m: torch.nn.Module, fill: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(p, fill) for k, p in m.named_parameters()}


def params_of(client: PSClient, m: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(p) for k, p in m.named_parameters()}
    client.pull(out, min_version=0)
    return out


def clients(address: str, n: int, optimizer: dict[str, Any], m: torch.nn.Module) -> list[PSClient]:
    out = [PSClient([address], rank=r, num_workers=n, incarnation=1, timeout=RPC_TIMEOUT) for r in range(n)]
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda c: c.init(m, optimizer, init_timeout=RPC_TIMEOUT), out))
    return out


def outcome(call: Any) -> Any:
    """The call's result, or (code, reason, details) of the RpcError it raised."""
    try:
        return call()
    except grpc.RpcError as exc:
        return exc.code(), reason_of(exc), exc.details()


def sync_round(cs: list[PSClient], m: torch.nn.Module, fill: float) -> list[Any]:
    """Every rank pushes ``fill`` gradients and pulls the round's result; per rank, the version or
    the refusal (of its push or of its pull)."""

    def one(c: PSClient) -> Any:
        pushed = outcome(lambda: c.push(grads(m, fill)))
        if isinstance(pushed, tuple):
            return pushed
        return outcome(lambda: c.pull({k: p.detach().clone() for k, p in m.named_parameters()}))

    with ThreadPoolExecutor(len(cs)) as pool:
        return list(pool.map(one, cs))


def optimizer_state(shard) -> list[dict[str, torch.Tensor]]:
    opt = shard.shard.store.optimizer
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in opt.param_groups[0]["params"] if p in opt.state]


def same_state(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True)
    )


def metric(url: str, name: str, labels: str) -> float:
    text = urllib.request.urlopen(url, timeout=RPC_TIMEOUT).read().decode()
    found = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


# ----------------------------------------------------------------------------- learning rates out of range
def test_learning_rate_out_of_range_is_refused_and_a_failing_step_wedges_nothing(start_cluster) -> None:
    (shard,) = start_cluster(num_shards=1, num_workers=2, mode="sync")
    m = model()
    cs = clients(shard.address, 2, {"name": "sgd", "lr": 0.1, "momentum": 0.9}, m)
    channel = grpc.insecure_channel(shard.address)
    admin = ps_pb2_grpc.AdminStub(channel)
    with pytest.raises(grpc.RpcError) as refused:
        admin.UpdateConfig(ps_pb2.UpdateConfigRequest(learning_rate=1e308), timeout=RPC_TIMEOUT)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "float32" in refused.value.details()
    assert shard.shard.learning_rate() == pytest.approx(0.1)
    (fresh,) = start_cluster(num_shards=1, num_workers=1, mode="sync")
    init = PSClient([fresh.address], rank=0, num_workers=1, incarnation=1, timeout=RPC_TIMEOUT)
    with pytest.raises(grpc.RpcError, match="float32") as refused:  # Init's optimizer spec: checked alike
        init.init(model(), {"name": "sgd", "lr": 1e39}, init_timeout=RPC_TIMEOUT)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and not fresh.shard.status().initialized

    # whatever makes a step raise (here a learning rate set behind the validation's back), the
    # round is refused as a whole: every rank told why, nothing applied, the next round proceeds
    before, state = params_of(cs[0], m), optimizer_state(shard)
    shard.shard.store.optimizer.param_groups[0]["lr"] = 1e308
    results = sync_round(cs, m, 1.0)
    for r in results:
        assert isinstance(r, tuple) and r[0] == grpc.StatusCode.ABORTED and r[1] == "UPDATE_FAILED", results
        assert "round 0" in r[2] and "nothing was applied" in r[2], r
    assert shard.shard.version == 0 and shard.shard.status().round_ranks == ()
    assert all(torch.equal(before[k], v) for k, v in params_of(cs[0], m).items())
    assert same_state(state, optimizer_state(shard))
    admin.UpdateConfig(ps_pb2.UpdateConfigRequest(learning_rate=0.1), timeout=RPC_TIMEOUT)
    assert sync_round(cs, m, 1.0) == [1, 1]
    for c in [*cs, init]:
        c.close()
    channel.close()


# ----------------------------------------------------------------------------- non-finite updates
@pytest.mark.parametrize("mode", ["sync", "async", "ssp", "easgd"])
def test_an_update_that_would_make_parameters_non_finite_is_refused_as_a_whole(start_cluster, mode) -> None:
    workers = 2 if mode == "sync" else 1
    (shard,) = start_cluster(num_shards=1, num_workers=workers, mode=mode, metrics_port=0)
    m = model(-3e38 if mode == "easgd" else None)
    cs = clients(shard.address, workers, {"name": "sgd", "lr": 2.0, "momentum": 0.5}, m)
    if mode == "sync":  # a first round fills the momentum buffers, so their rollback is tested
        assert sync_round(cs, m, 1.0) == [1, 1]
    elif mode != "easgd":
        cs[0].push(grads(m, 1.0))
    version, before, state = shard.shard.version, params_of(cs[0], m), optimizer_state(shard)

    if mode == "sync":  # two finite gradients whose sum overflows float32
        results = sync_round(cs, m, 3e38)
    elif mode == "easgd":  # x - center overflows
        results = [outcome(lambda: cs[0].exchange({k: torch.full_like(p, 3e38) for k, p in m.named_parameters()}))]
    else:  # a finite gradient whose step overflows
        results = [outcome(lambda: cs[0].push(grads(m, 3e38)))]
    for r in results:
        assert isinstance(r, tuple) and r[0] == grpc.StatusCode.ABORTED and r[1] == "NON_FINITE_UPDATE", results
        assert "non-finite" in r[2] and "unchanged" in r[2], r
    assert shard.shard.version == version
    after = params_of(cs[0], m)
    assert all(torch.equal(before[k], v) for k, v in after.items())
    assert same_state(state, optimizer_state(shard))
    if mode == "sync":  # through PushPull (DistributedOptimizer's path) workers count the refusal and carry on
        refused = [c.refused_pushes for c in cs]
        with ThreadPoolExecutor(2) as pool:
            outs = [{k: p.detach().clone() for k, p in m.named_parameters()} for _ in cs]
            versions = list(pool.map(lambda i: cs[i].push_pull(grads(m, 3e38), outs[i]), range(2)))
        assert versions == [version] * 2 and [c.refused_pushes - n for c, n in zip(cs, refused, strict=True)] == [1, 1]
        assert shard.shard.version == version and all(torch.equal(before[k], v) for k, v in outs[0].items())

    refusals = len(results) * (2 if mode == "sync" else 1)
    assert shard.shard.status().rejected_pushes.get("non_finite_update") == refusals
    assert metric(shard.metrics_url, "ps_rejected_pushes_total", 'reason="non_finite_update"') == refusals
    assert metric(shard.metrics_url, "ps_rejected_pushes_total", 'reason="stale"') == 0

    # the next valid update proceeds
    if mode == "sync":
        assert sync_round(cs, m, 1.0) == [version + 1] * 2
    elif mode == "easgd":
        cs[0].exchange({k: p.detach().clone() for k, p in m.named_parameters()})
    else:
        cs[0].push(grads(m, 1.0))
    assert shard.shard.version == version + 1
    assert all(torch.isfinite(v).all() for v in params_of(cs[0], m).values())
    for c in cs:
        c.close()


# ----------------------------------------------------------------------------- replays beyond the window
def push_at(c: PSClient, m: torch.nn.Module, clock: int) -> Any:
    c.clock = clock
    return outcome(lambda: c.push(grads(m, 0.001)))


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_push_replayed_beyond_the_window_is_refused_also_after_a_restart(start_cluster, tmp_path, mode) -> None:
    config = {"mode": mode, "checkpoint_dir": str(tmp_path), "checkpoint_every": 1}
    (shard,) = start_cluster(num_shards=1, num_workers=1, **config)
    m = model()
    (c,) = clients(shard.address, 1, {"name": "sgd", "lr": 0.1}, m)
    for clock in range(70):
        assert not isinstance(push_at(c, m, clock), tuple)
    assert shard.shard.version == 70
    assert push_at(c, m, 69)[0].duplicate  # in the window: the original answer
    replay = push_at(c, m, 0)
    assert replay[0] == grpc.StatusCode.ABORTED and replay[1] == "REPLAYED", replay
    assert shard.shard.version == 70
    c.close()

    shard.stop(grace=0.5)  # writes its final checkpoint; the restarted shard resumes from it
    (again,) = start_cluster(num_shards=1, num_workers=1, **config)
    assert again.shard.restored_from_version == 70
    c = PSClient([again.address], rank=0, num_workers=1, incarnation=1, timeout=RPC_TIMEOUT)
    c.init(m, {"name": "sgd", "lr": 0.1}, init_timeout=RPC_TIMEOUT)
    for clock in (0, 5):  # the mark survived the restart
        replay = push_at(c, m, clock)
        assert isinstance(replay, tuple) and replay[1] == "REPLAYED", (clock, replay)
    assert push_at(c, m, 69)[0].duplicate  # and so did the window of answers
    assert again.shard.version == 70
    assert not isinstance(push_at(c, m, 70), tuple) and again.shard.version == 71
    c.close()


def test_a_replayed_exchange_does_not_move_the_center(start_cluster) -> None:
    (shard,) = start_cluster(num_shards=1, num_workers=1, mode="easgd")
    m = model()
    (c,) = clients(shard.address, 1, {"name": "sgd", "lr": 0.1}, m)
    x = {k: torch.full_like(p, 5.0) for k, p in m.named_parameters()}
    for _ in range(2):
        c.exchange({k: v.clone() for k, v in x.items()})
    before = params_of(c, m)
    c.exchanges = 0  # replay the first exchange
    replay = outcome(lambda: c.exchange({k: v.clone() for k, v in x.items()}))
    assert isinstance(replay, tuple) and replay[0] == grpc.StatusCode.ABORTED and replay[1] == "REPLAYED", replay
    assert shard.shard.version == 2
    assert all(torch.equal(before[k], v) for k, v in params_of(c, m).items())
    c.close()


# ----------------------------------------------------------------------------- a paused shard
def test_a_paused_shard_evicts_nobody_when_it_resumes(tmp_path) -> None:
    lease = 2.0
    log = (tmp_path / "shard.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ps_server.cli", "--shard-index", "0", "--num-shards", "1", "--num-workers", "2"]
        + ["--mode", "sync", "--port", "0", "--metrics-port", "-1", "--lease-timeout", str(lease)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        address = ""
        while not address and time.monotonic() < deadline:
            if not select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                break
            line = proc.stdout.readline()
            found = re.search(r"listening on (\S+)", line)
            address = found.group(1) if found else address
            assert line or proc.poll() is None, "ps-server exited before it listened"
        assert address, "ps-server did not listen within 60 s"
        channel = grpc.insecure_channel(address)
        stub = ps_pb2_grpc.ParameterServiceStub(channel)
        for rank in (0, 1):
            stub.Join(ps_pb2.JoinRequest(rank=rank, num_workers=2, incarnation=1), timeout=RPC_TIMEOUT)

        os.kill(proc.pid, signal.SIGSTOP)
        try:
            time.sleep(3 * lease)  # the shard's own pause: what is measured, not a synchronization
        finally:
            os.kill(proc.pid, signal.SIGCONT)

        # both ranks heartbeat as soon as the shard answers again, and stay live for two leases
        deadline = time.monotonic() + 2 * lease
        while time.monotonic() < deadline:
            for rank in (0, 1):
                reply = stub.Heartbeat(ps_pb2.HeartbeatRequest(rank=rank, incarnation=1), timeout=RPC_TIMEOUT)
                assert reply.state == ps_pb2.WORKER_STATE_LIVE, f"rank {rank} was evicted after the shard's pause"
            time.sleep(lease / 8)
        channel.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
    assert "evicted" not in (tmp_path / "shard.log").read_text()
