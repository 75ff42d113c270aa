"""Shard 0 decides membership and configuration for every shard (ps_server.membership.epochs), over real gRPC.

The first test reproduces the failure the README used to document as a known limitation: a shard
restarts while one rank's connection to it is cut for longer than the lease. Each shard used to evict
on its own lease clock, so the restarted shard evicted the rank that shard 0 still counted, and the two
sync workers then waited on each other until their deadline. Now only shard 0 evicts, and it heard
from the rank all along: both ranks train to the end, every round counted the same on both shards.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest

from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_server.membership.ranks import WorkerState
from tests.conftest import RPC_TIMEOUT

LEASE = 1.5


class CuttableLink:
    """A TCP forwarder on 127.0.0.1 to ``target`` whose link can be cut (every connection closed,
    new ones refused) and mended: one rank's channel to one shard, broken while the shard restarts."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.cut_off = threading.Event()
        self.closed = threading.Event()
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                down, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.cut_off.is_set():
                down.close()
                continue
            try:
                up = socket.create_connection(self.target, timeout=2)
            except OSError:
                down.close()
                continue
            with self.lock:
                self.conns += [down, up]
            for a, b in ((down, up), (up, down)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                t.start()
                self.threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.2)
        while not self.closed.is_set() and not self.cut_off.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            s.close()

    def cut(self) -> None:
        self.cut_off.set()
        with self.lock:
            for s in self.conns:
                s.close()
            self.conns.clear()

    def mend(self) -> None:
        self.cut_off.clear()

    def close(self) -> None:
        self.closed.set()
        self.cut()
        self.listener.close()
        for t in self.threads:
            t.join(5)


@pytest.fixture
def link() -> Iterator[list[CuttableLink]]:
    made: list[CuttableLink] = []
    yield made
    for link in made:
        link.close()


def status(address: str) -> ps_pb2.ShardStatus:
    with grpc.insecure_channel(address) as ch:
        return ps_pb2_grpc.AdminStub(ch).GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT).status


def test_a_rank_cut_off_from_a_restarting_shard_is_not_evicted_there_and_both_ranks_finish(
    start_cluster, start_trainer, wait_until, link, tmp_path
) -> None:
    shards = start_cluster(2, num_workers=2, lease_timeout=LEASE, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    cut = CuttableLink(("127.0.0.1", shards[1].port))
    link.append(cut)
    steps = 60
    trainers = [
        start_trainer([shards[0].address, shards[1].address], rank=0, num_workers=2, max_steps=steps, pace=0.02),
        start_trainer(
            [shards[0].address, cut.address], rank=1, num_workers=2, max_steps=steps, pace=0.02, retry_deadline=30
        ),
    ]
    wait_until(lambda: min(t.steps for t in trainers) >= 10 or any(t.error for t in trainers), 60, "10 steps")
    # shard 1 restarts from its checkpoint while rank 1's link to it stays cut for twice the lease:
    # shard 1 hears nothing from rank 1 for that long, shard 0 hears its heartbeats all along
    cut.cut()
    cut_at = time.monotonic()
    shards[1].stop(grace=0.5)
    started: list = []

    def restart() -> bool:
        try:
            started.append(start_cluster.start(replace(shards[1].config, port=shards[1].port)))
        except RuntimeError:  # the old socket is not released yet
            return False
        return True

    wait_until(restart, 20, f"port {shards[1].port} to bind again")
    restarted = started[0]
    wait_until(lambda: status(restarted.address).initialized, 30, "shard 1 to resume")
    threading.Event().wait(max(0.0, cut_at + 2 * LEASE - time.monotonic()))  # the fault's length, not a sync
    assert restarted.shard.status().workers[1].state is WorkerState.LIVE  # shard 1 evicts nobody
    cut.mend()
    wait_until(lambda: all(t.steps >= steps for t in trainers) or any(t.error for t in trainers), 120, "the end")
    for t in trainers:
        t.stop()
    first, second = status(shards[0].address), status(restarted.address)
    assert first.version == second.version  # the same rounds on both shards
    assert not first.membership.reason.startswith("rank 1 evicted")


def test_a_mode_switch_applies_at_the_same_version_on_both_shards(start_cluster, start_trainer, wait_until) -> None:
    shards = start_cluster(2, num_workers=2)
    trainers = [start_trainer([s.address for s in shards], rank=r, num_workers=2, pace=0.02) for r in (0, 1)]
    wait_until(lambda: min(t.steps for t in trainers) >= 3 or any(t.error for t in trainers), 60, "3 steps")
    with grpc.insecure_channel(shards[1].address) as ch:  # a follower refuses, naming shard 0
        with pytest.raises(grpc.RpcError) as err:
            ps_pb2_grpc.AdminStub(ch).UpdateConfig(ps_pb2.UpdateConfigRequest(mode=ps_pb2.MODE_ASYNC), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "send UpdateConfig to shard 0" in str(err.value)
    with grpc.insecure_channel(shards[0].address) as ch:
        reply = ps_pb2_grpc.AdminStub(ch).UpdateConfig(
            ps_pb2.UpdateConfigRequest(mode=ps_pb2.MODE_ASYNC, max_staleness=5), timeout=RPC_TIMEOUT
        )
    switched = lambda: all(status(s.address).config.mode == ps_pb2.MODE_ASYNC for s in shards)  # noqa: E731
    wait_until(lambda: switched() or any(t.error for t in trainers), 60, "both shards to switch")
    applied = [[(c.version, c.epoch) for c in status(s.address).applied_changes] for s in shards]
    assert applied == [[(reply.at_version, reply.membership_epoch)]] * 2  # the same version, read from GetStatus
    steps = min(t.steps for t in trainers)
    wait_until(lambda: min(t.steps for t in trainers) >= steps + 3 or any(t.error for t in trainers), 60, "async steps")
    for t in trainers:
        t.stop()


def test_records_are_signed_with_the_admin_token_and_a_forged_one_is_refused(start_cluster) -> None:
    worker, admin = (("authorization", "Bearer w-token"),), (("authorization", "Bearer a-token"),)
    shards = start_cluster(2, num_workers=2, token="w-token", admin_token="a-token")
    with grpc.insecure_channel(shards[0].address) as ch0, grpc.insecure_channel(shards[1].address) as ch1:
        join = ps_pb2.JoinRequest(rank=0, num_workers=2, incarnation=1)
        for ch in (ch0, ch1):  # rank 0 live on both: only a live rank's heartbeat relays records
            ps_pb2_grpc.ParameterServiceStub(ch).Join(join, timeout=RPC_TIMEOUT, metadata=worker)
        ps_pb2_grpc.AdminStub(ch0).EvictWorker(ps_pb2.EvictWorkerRequest(rank=1), timeout=RPC_TIMEOUT, metadata=admin)
        beat = ps_pb2.HeartbeatRequest(rank=0, incarnation=1)
        record = ps_pb2_grpc.ParameterServiceStub(ch0).Heartbeat(beat, timeout=RPC_TIMEOUT, metadata=worker).membership
        assert record.epoch > 0 and len(record.signature) == 32  # shard 0's answer to an older epoch
        forged = ps_pb2.MembershipEpoch()
        forged.CopyFrom(record)
        forged.members[1].state = ps_pb2.WORKER_STATE_LIVE  # a worker un-evicts itself
        follower = ps_pb2_grpc.ParameterServiceStub(ch1)
        with pytest.raises(grpc.RpcError) as err:
            follower.Heartbeat(
                ps_pb2.HeartbeatRequest(rank=0, incarnation=1, membership=forged), timeout=RPC_TIMEOUT, metadata=worker
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not signed by shard 0" in err.value.details()
        assert status_with(ch1, admin).membership.epoch == 0  # nothing changed
        follower.Heartbeat(
            ps_pb2.HeartbeatRequest(rank=0, incarnation=1, membership=record), timeout=RPC_TIMEOUT, metadata=worker
        )
        assert status_with(ch1, admin).membership.epoch == record.epoch  # the real one is followed
        assert shards[1].shard.members[1].counted is False


def status_with(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> ps_pb2.ShardStatus:
    return (
        ps_pb2_grpc.AdminStub(channel)
        .GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT, metadata=metadata)
        .status
    )


WORKER, ADMIN = (("authorization", "Bearer w-token"),), (("authorization", "Bearer a-token"),)


def decisions_of_another_job(start_cluster) -> list[ps_pb2.MembershipEpoch]:
    """The signed records another job with the same tokens decided before it stopped: a resize to 1
    worker, then a learning rate of 5.0 (what a client with only the worker token could have kept).
    Started after the caller's cluster, its epochs are above that cluster's (an epoch's floor is its
    shard 0's start second), so only the cluster id tells them apart."""
    from ps_worker import PSClient
    from tests.conftest import small_model

    old = start_cluster(2, num_workers=2, token="w-token", admin_token="a-token")
    with PSClient(old.addresses, rank=0, num_workers=2, incarnation=1, timeout=RPC_TIMEOUT, token="w-token") as c:
        c.init(small_model(), {"name": "sgd", "lr": 0.1})
    records = []
    with grpc.insecure_channel(old[0].address) as ch:
        admin, worker = ps_pb2_grpc.AdminStub(ch), ps_pb2_grpc.ParameterServiceStub(ch)
        beat = ps_pb2.HeartbeatRequest(rank=0, incarnation=1)
        admin.Resize(ps_pb2.ResizeRequest(num_workers=1), timeout=RPC_TIMEOUT, metadata=ADMIN)
        records.append(worker.Heartbeat(beat, timeout=RPC_TIMEOUT, metadata=WORKER).membership)
        admin.UpdateConfig(ps_pb2.UpdateConfigRequest(learning_rate=5.0), timeout=RPC_TIMEOUT, metadata=ADMIN)
        records.append(worker.Heartbeat(beat, timeout=RPC_TIMEOUT, metadata=WORKER).membership)
    for s in old:
        s.stop()
    assert [len(r.signature) for r in records] == [32, 32] and records[0].num_workers == 1
    return records


def admin_status(address: str) -> ps_pb2.ShardStatus:
    with grpc.insecure_channel(address) as ch:
        return status_with(ch, ADMIN)


def test_a_record_of_an_earlier_job_with_the_same_admin_token_is_refused_by_a_new_cluster(start_cluster) -> None:
    """Records of a stopped job, relayed by a client holding only the new job's
    worker token, neither resize the new job nor set its learning rate, on any shard."""
    from ps_worker import PSClient
    from tests.conftest import small_model

    shards = start_cluster(2, num_workers=2, token="w-token", admin_token="a-token")
    clients = [
        PSClient(shards.addresses, rank=r, num_workers=2, incarnation=1, timeout=RPC_TIMEOUT, token="w-token")
        for r in (0, 1)
    ]
    try:
        for c in clients:
            c.init(small_model(), {"name": "sgd", "lr": 0.1})
        before = [admin_status(s.address) for s in shards]
        records = decisions_of_another_job(start_cluster)
        assert min(r.epoch for r in records) > max(b.membership.epoch for b in before)
        for s in shards:
            with grpc.insecure_channel(s.address) as ch:
                stub = ps_pb2_grpc.ParameterServiceStub(ch)
                for record in records:
                    replay = ps_pb2.HeartbeatRequest(rank=1, incarnation=1, membership=record)
                    with pytest.raises(grpc.RpcError) as err:
                        stub.Heartbeat(replay, timeout=RPC_TIMEOUT, metadata=WORKER)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert "another job" in err.value.details()
        for s, b in zip(shards, before, strict=True):
            after = admin_status(s.address)
            assert after.config.num_workers == 2 and after.config.learning_rate == pytest.approx(0.1)
            assert after.membership.epoch == b.membership.epoch and s.shard.members[1].counted
        assert len({b.membership.cluster_id for b in before}) == 1 and before[0].membership.cluster_id
    finally:
        for c in clients:
            c.close()


def test_a_record_in_a_refused_heartbeat_is_not_followed(start_cluster) -> None:
    """A record is followed only from a request that passed its own checks: a Heartbeat of a rank out
    of range carrying shard 0's genuine record is refused and the record is not adopted."""
    shards = start_cluster(2, num_workers=2, token="w-token", admin_token="a-token")
    with grpc.insecure_channel(shards[0].address) as ch0, grpc.insecure_channel(shards[1].address) as ch1:
        ps_pb2_grpc.AdminStub(ch0).EvictWorker(ps_pb2.EvictWorkerRequest(rank=1), timeout=RPC_TIMEOUT, metadata=ADMIN)
        beat = ps_pb2.HeartbeatRequest(rank=0, incarnation=0)
        record = ps_pb2_grpc.ParameterServiceStub(ch0).Heartbeat(beat, timeout=RPC_TIMEOUT, metadata=WORKER).membership
        assert record.epoch > 0
        follower = ps_pb2_grpc.ParameterServiceStub(ch1)
        for refused in (
            ps_pb2.HeartbeatRequest(rank=99, membership=record),  # no such rank
            ps_pb2.HeartbeatRequest(rank=0, incarnation=0, membership=record),
        ):
            if refused.rank == 0:  # a superseded incarnation: rank 0 joined with 5 first
                shards[1].shard.join(0, 2, 5)
            with pytest.raises(grpc.RpcError) as err:
                follower.Heartbeat(refused, timeout=RPC_TIMEOUT, metadata=WORKER)
            assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
            assert status_with(ch1, ADMIN).membership.epoch == 0 and shards[1].shard.members[1].counted
        accepted = ps_pb2.HeartbeatRequest(rank=0, incarnation=5, membership=record)
        follower.Heartbeat(accepted, timeout=RPC_TIMEOUT, metadata=WORKER)
        assert status_with(ch1, ADMIN).membership.epoch == record.epoch and not shards[1].shard.members[1].counted


def test_with_a_cluster_id_a_fresh_follower_refuses_another_jobs_record_before_its_first(start_cluster) -> None:
    """Without ``--cluster-id`` a shard that has followed no record yet pins the cluster of the first
    one it follows; with it, a record of an earlier job (same admin token) relayed in a Join before any
    worker joined is refused, and the job's own records are followed afterwards."""
    from ps_worker import PSClient
    from tests.conftest import small_model

    records = decisions_of_another_job(start_cluster)
    shards = start_cluster(2, num_workers=2, token="w-token", admin_token="a-token", cluster_id="job-b")
    with grpc.insecure_channel(shards[1].address) as ch:
        stub = ps_pb2_grpc.ParameterServiceStub(ch)
        for record in records:
            join = ps_pb2.JoinRequest(rank=1, num_workers=2, incarnation=1, membership=record)
            with pytest.raises(grpc.RpcError) as err:
                stub.Join(join, timeout=RPC_TIMEOUT, metadata=WORKER)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "another job" in err.value.details()
    assert shards[1].shard.epochs.cluster_id == "job-b" and shards[1].shard.num_workers == 2
    clients = [
        PSClient(shards.addresses, rank=r, num_workers=2, incarnation=2, timeout=RPC_TIMEOUT, token="w-token")
        for r in (0, 1)
    ]
    try:
        for c in clients:
            c.init(small_model(), {"name": "sgd", "lr": 0.1})
        after = [admin_status(s.address) for s in shards]
        assert [a.membership.cluster_id for a in after] == ["job-b", "job-b"]
        assert [a.config.num_workers for a in after] == [2, 2]
    finally:
        for c in clients:
            c.close()
