"""Job-level faults against real shards over gRPC: a rank that never joins.

Before ``--join-timeout``, a sync round waited for a rank that never joined for as long as anyone
waited: rank 0 looped on DEADLINE_EXCEEDED, naming nothing it could act on, and the shard said
nothing. Now, once the join timeout after the first Join has passed, every wait that needs the
missing rank fails with FAILED_PRECONDITION (reason JOIN_TIMEOUT) naming it, the shard logs it once
and counts it in its status, and the job goes on if the rank joins after all.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
import torch

from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_worker.client import PSClient, reason_of
from tests.conftest import RPC_TIMEOUT

JOIN_TIMEOUT = 2.0


def status(address: str) -> ps_pb2.ShardStatus:
    with grpc.insecure_channel(address) as ch:
        return ps_pb2_grpc.AdminStub(ch).GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT).status


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def grads_of(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(p, 0.1) for k, p in m.named_parameters()}


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_join_timeout_names_the_ranks_that_never_joined(start_cluster, caplog, mode: str) -> None:
    (shard,) = start_cluster(1, num_workers=3, mode=mode, join_timeout=JOIN_TIMEOUT, lease_timeout=30.0)
    m = model()
    params = {k: p.data for k, p in m.named_parameters()}
    caplog.set_level(logging.ERROR, logger="ps_server.shard.members")
    # a generous RPC deadline: before the fix this pull waited all of it (and was retried)
    with PSClient([shard.address], rank=0, num_workers=3, timeout=30, retry_deadline=5) as client:
        joined = time.monotonic()  # just before the first Join (in init)
        client.init(m, {"name": "sgd", "lr": 0.1})
        client.push(grads_of(m))
        with pytest.raises(grpc.RpcError) as info:
            client.pull(params, min_version=1 if mode == "sync" else None)
            client.push(grads_of(m))  # ssp with s=0: the second clock's read waits for ranks 1 and 2
            client.pull(params)
        waited = time.monotonic() - joined
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value
        assert reason_of(info.value) == "JOIN_TIMEOUT"
        assert "Ranks [1, 2] never joined shard 0 within --join-timeout 2 s" in info.value.details()
        assert "ps-admin evict 1" in info.value.details()
        assert JOIN_TIMEOUT - 0.5 <= waited < 20, waited  # at the join deadline, not at the RPC's
        # visible to operators: in the status (once) and in the log (once)
        st = status(shard.address)
        assert st.rejected_pushes["join_timeout"] == 1
        assert [w.state for w in st.workers][1:] == [ps_pb2.WORKER_STATE_PENDING] * 2
        logged = [r.getMessage() for r in caplog.records if "never joined" in r.getMessage()]
        assert len(logged) == 1 and "Ranks [1, 2]" in logged[0]
        # a wait that starts after the deadline fails at once
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as again:
            client.pull(params, min_version=client.version + 1) if mode == "sync" else client.pull(params)
        assert reason_of(again.value) == "JOIN_TIMEOUT" and time.monotonic() - start < 5


def test_late_ranks_and_evicted_ranks_let_the_job_go_on(start_cluster) -> None:
    (shard,) = start_cluster(1, num_workers=3, join_timeout=JOIN_TIMEOUT, lease_timeout=30.0)
    m0, m1 = model(), model()
    p0 = {k: p.data for k, p in m0.named_parameters()}
    p1 = {k: p.data for k, p in m1.named_parameters()}
    with (
        PSClient([shard.address], rank=0, num_workers=3, timeout=30, retry_deadline=5) as c0,
        PSClient([shard.address], rank=1, num_workers=3, timeout=30, retry_deadline=5) as c1,
    ):
        c0.init(m0, {"name": "sgd", "lr": 0.1})
        c0.push(grads_of(m0))
        with pytest.raises(grpc.RpcError) as info:
            c0.pull(p0, min_version=1)
        assert reason_of(info.value) == "JOIN_TIMEOUT"
        # rank 1 comes after the deadline: it is no longer missing; rank 2 still is
        c1.init(m1, {"name": "sgd", "lr": 0.1})
        c1.push(grads_of(m1))
        with pytest.raises(grpc.RpcError) as still:
            c1.pull(p1, min_version=1)
        assert "Ranks [2] never joined" in still.value.details()
        # the operator goes on without rank 2: the round that held ranks 0 and 1 closes
        with grpc.insecure_channel(shard.address) as ch:
            ps_pb2_grpc.AdminStub(ch).EvictWorker(ps_pb2.EvictWorkerRequest(rank=2), timeout=RPC_TIMEOUT)
        assert c0.pull(p0, min_version=1) == 1 and c1.pull(p1, min_version=1) == 1
        assert torch.equal(p0["weight"], p1["weight"])


def test_no_join_deadline_before_the_first_join_and_none_when_disabled(start_cluster) -> None:
    # shards up long before their workers: the clock starts at the first Join, not at the shard's start
    (late,) = start_cluster(1, num_workers=2, join_timeout=0.5, lease_timeout=30.0)
    (never,) = start_cluster(1, num_workers=2, join_timeout=0, lease_timeout=30.0)
    time.sleep(1.0)  # not a synchronization: the time that passes before any worker comes
    for shard in (late, never):
        m = model()
        with (
            PSClient([shard.address], rank=0, num_workers=2, timeout=30) as c0,
            PSClient([shard.address], rank=1, num_workers=2, timeout=30) as c1,
        ):
            c0.init(m, {"name": "sgd", "lr": 0.1})
            c1.init(model(), {"name": "sgd", "lr": 0.1})
            for c in (c0, c1):
                c.push(grads_of(m))
            assert c0.pull({k: p.data for k, p in m.named_parameters()}, min_version=1) == 1
    assert "join_timeout" not in status(never.address).rejected_pushes
    # join_timeout=0 waits forever: the shard's wait for rank 1 ends only at the RPC deadline, as before
    (forever,) = start_cluster(1, num_workers=2, join_timeout=0, lease_timeout=30.0)
    with PSClient([forever.address], rank=0, num_workers=2, timeout=1.5, retry_deadline=0.1) as c0:
        m = model()
        c0.init(m, {"name": "sgd", "lr": 0.1})
        c0.push(grads_of(m))
        with pytest.raises(grpc.RpcError) as info:
            c0.pull({k: p.data for k, p in m.named_parameters()})
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_missing_backup_rank_does_not_stop_a_quorum(start_cluster, wait_until) -> None:
    # --sync-quorum 2 of 3: rank 2 never joins, but ranks 0 and 1 close every round without it
    (shard,) = start_cluster(1, num_workers=3, sync_quorum=2, join_timeout=1.0, lease_timeout=30.0)
    m0, m1 = model(), model()
    p0 = {k: p.data for k, p in m0.named_parameters()}
    p1 = {k: p.data for k, p in m1.named_parameters()}
    with (
        PSClient([shard.address], rank=0, num_workers=3, timeout=30, retry_deadline=5) as c0,
        PSClient([shard.address], rank=1, num_workers=3, timeout=30, retry_deadline=5) as c1,
    ):
        c0.init(m0, {"name": "sgd", "lr": 0.1})
        c1.init(m1, {"name": "sgd", "lr": 0.1})
        wait_until(lambda: status(shard.address).rejected_pushes["join_timeout"] == 1, 20, "the join deadline")
        c0.push(grads_of(m0))
        pulled: list[int] = []
        reader = threading.Thread(target=lambda: pulled.append(c0.pull(p0, min_version=1)), daemon=True)
        reader.start()  # rank 0 waits for the round past the deadline: for rank 1, not for rank 2
        c1.push(grads_of(m1))
        reader.join(30)
        assert pulled == [1] and c1.pull(p1, min_version=1) == 1
