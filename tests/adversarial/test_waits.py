"""Waiting calls cannot wedge a shard: a wait ends when its call is cancelled or its deadline passes,
a ``min_version`` no wait can reach is refused at once, and however many calls wait, Health, Admin
and Join keep threads of their own.

The attacks hold only the worker token: 17 calls of one kind (one more than the 16 threads of a
2-worker shard's pool), each of which waits (a Pull or PullRows for the next round that never
closes, an InitTables of rank 1 before rank 0 declared, a Pull with a 1-hour deadline, a PushPull
stream that sent only its header).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_common.tables import RowOptimizerSpec, TableSpec
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_worker import PSClient
from tests.conftest import small_model

TOKEN = "worker-secret"
ADMIN_TOKEN = "admin-secret"
WORKER = (("authorization", f"Bearer {TOKEN}"),)
ADMIN = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
HUGE = 2**63
ATTACK = 17
"""Waiting calls per attack: more than the 16 threads of the shard's gRPC pool."""
ANSWER_SECONDS = 1.0
"""How fast Health, GetStatus and Join must answer while the attack is in place."""
RELEASE_SECONDS = 15.0
"""How long the shard may take to serve a new wave once the attack's calls are cancelled."""
CALL_TIMEOUT = 30.0
"""Deadline of an attacking call that is not about deadlines: far beyond the test's checks."""


class Attack:
    """``ATTACK`` waiting calls of one kind on their own channels, cancelled by :meth:`cancel`."""

    def __init__(self, address: str) -> None:
        self.channels = [
            grpc.insecure_channel(address, options=[("grpc.primary_user_agent", f"attacker{i}")]) for i in range(4)
        ]
        self.calls: list[Any] = []
        self._hold = threading.Event()  # PushPull's request stream stays open until set
        self.session: int | None = None

    def stub(self) -> ps_pb2_grpc.ParameterServiceStub:
        return ps_pb2_grpc.ParameterServiceStub(self.channels[len(self.calls) % len(self.channels)])

    def pull(self, digest: str, min_version: int, timeout: float | None) -> None:
        request = ps_pb2.PullRequest(rank=1, incarnation=HUGE, min_version=min_version, plan_digest=digest)
        self.calls.append(self.stub().Pull(request, timeout=timeout, metadata=WORKER))

    def pull_rows(self, min_version: int) -> None:
        block = ps_pb2.RowBlock(table="emb", ids=(3).to_bytes(8, "little"))
        request = ps_pb2.PullRowsRequest(rank=1, incarnation=HUGE, min_version=min_version, blocks=[block])
        self.calls.append(self.stub().PullRows.future(request, timeout=CALL_TIMEOUT, metadata=WORKER))

    def init_tables(self) -> None:
        request = ps_pb2.InitTablesRequest(rank=1, incarnation=HUGE, tables=[table_spec()])
        self.calls.append(self.stub().InitTables.future(request, timeout=CALL_TIMEOUT, metadata=WORKER))

    def push_pull_header(self, digest: str) -> None:
        """A PushPull of rank 1 that sends its header (with the session of a Join the attacker made:
        a header without one is refused at once) and then nothing more."""
        if self.session is None:
            join = ps_pb2.JoinRequest(rank=1, num_workers=2, incarnation=1)  # the checks' Joins take 2, 3, ...
            self.session = self.stub().Join(join, timeout=CALL_TIMEOUT, metadata=WORKER).session
        header = ps_pb2.PushHeader(rank=1, incarnation=1, clock=0, plan_digest=digest, session=self.session)

        def requests() -> Iterator[ps_pb2.PushPullRequest]:
            yield ps_pb2.PushPullRequest(header=header)
            self._hold.wait(CALL_TIMEOUT)

        self.calls.append(self.stub().PushPull(requests(), timeout=CALL_TIMEOUT, metadata=WORKER))

    def cancel(self) -> None:
        self._hold.set()
        for call in self.calls:
            call.cancel()
        for channel in self.channels:
            channel.close()


def table_spec() -> ps_pb2.TableSpec:
    from ps_common.wire import table_spec_to_proto

    return table_spec_to_proto(TableSpec("emb", 1000, 4, RowOptimizerSpec("sgd", {"lr": 0.1})))


def answers_at_once(address: str, incarnations: Iterator[int]) -> None:
    """Health, Admin/GetStatus and Join each answer within ``ANSWER_SECONDS`` (a fresh channel)."""
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=5)
        started = time.monotonic()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_SECONDS)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        ps_pb2_grpc.AdminStub(channel).GetStatus(ps_pb2.GetStatusRequest(), timeout=ANSWER_SECONDS, metadata=ADMIN)
        join = ps_pb2.JoinRequest(rank=1, num_workers=2, incarnation=next(incarnations))
        ps_pb2_grpc.ParameterServiceStub(channel).Join(join, timeout=ANSWER_SECONDS, metadata=WORKER)
        assert time.monotonic() - started < 3 * ANSWER_SECONDS


def wave_served(address: str, digest: str, tables: bool) -> bool:
    """Eight calls of the kinds the attacks used, each served at once (a Pull of a version the
    shard holds, a PullRows of the round it holds): True when all answered OK within 5 s."""
    with grpc.insecure_channel(address) as channel:
        stub = ps_pb2_grpc.ParameterServiceStub(channel)

        def one(i: int) -> bool:
            try:
                if tables and i % 2:
                    block = ps_pb2.RowBlock(table="emb", ids=(3).to_bytes(8, "little"))
                    request = ps_pb2.PullRowsRequest(rank=1, incarnation=HUGE, min_version=0, blocks=[block])
                    stub.PullRows(request, timeout=5, metadata=WORKER)
                else:
                    request = ps_pb2.PullRequest(rank=1, incarnation=HUGE, min_version=0, plan_digest=digest)
                    list(stub.Pull(request, timeout=5, metadata=WORKER))
                return True
            except grpc.RpcError:
                return False

        with futures.ThreadPoolExecutor(8) as pool:
            return all(pool.map(one, range(8)))


@pytest.fixture
def shard(start_cluster) -> Iterator[tuple[Any, PSClient]]:
    """One sync shard of 2 workers with tokens, initialized by rank 0 (whose client stays open);
    rank 1 never pushes, so the round stays open."""
    (server,) = start_cluster(1, num_workers=2, mode="sync", token=TOKEN, admin_token=ADMIN_TOKEN, lease_timeout=60)
    client = PSClient([server.address], rank=0, num_workers=2, timeout=10, retry_deadline=5, token=TOKEN)
    client.init(small_model(), {"name": "sgd", "lr": 0.1}, init_timeout=20)
    yield server, client
    client.close()


def digest_of(server: Any) -> str:
    return server.shard.plan.digest


def held_calls(server: Any) -> int:
    """Waiting calls the shard holds now (admitted and not yet ended)."""
    return server.waiting.open


ATTACKS: dict[str, Callable[[Attack, Any], None]] = {
    "pull": lambda a, s: a.pull(digest_of(s), 1, CALL_TIMEOUT),
    "pull-no-deadline": lambda a, s: a.pull(digest_of(s), 1, None),
    "pull-1-hour": lambda a, s: a.pull(digest_of(s), 1, 3600.0),
    "pull-rows": lambda a, s: a.pull_rows(1),
    "push-pull-header": lambda a, s: a.push_pull_header(digest_of(s)),
}


@pytest.mark.parametrize("kind", [*ATTACKS, "init-tables"])
def test_waiting_calls_leave_health_admin_join_their_threads(shard, kind: str, wait_until) -> None:
    """17 waiting calls of one kind: Health, GetStatus and Join still answer within 1 s; once the
    calls are cancelled their threads come back (a new wave is served, nothing is held)."""
    server, client = shard
    tables = kind != "init-tables"
    if tables:
        client.init_tables([TableSpec("emb", 1000, 4, RowOptimizerSpec("sgd", {"lr": 0.1}))])
    incarnations = itertools.count(2)
    attack = Attack(server.address)
    try:
        for _ in range(ATTACK):
            if kind == "init-tables":
                attack.init_tables()
            else:
                ATTACKS[kind](attack, server)
        admitted = min(ATTACK, server.waiting.limit)  # the others are refused at once (TOO_MANY_WAITS)
        wait_until(lambda: held_calls(server) == admitted, 10, "the attack's calls to wait on the shard")
        answers_at_once(server.address, incarnations)
    finally:
        attack.cancel()
    wait_until(lambda: held_calls(server) == 0, RELEASE_SECONDS, "the cancelled calls to end their waits")
    assert wave_served(server.address, digest_of(server), tables)
    answers_at_once(server.address, incarnations)


@pytest.mark.parametrize("what", ["pull", "pull-rows"])
def test_unreachable_min_version_is_refused_at_once(shard, what: str) -> None:
    """A read for version 2^63 waits for nothing: OUT_OF_RANGE at once, naming the version held."""
    server, client = shard
    client.init_tables([TableSpec("emb", 1000, 4, RowOptimizerSpec("sgd", {"lr": 0.1}))])
    with grpc.insecure_channel(server.address) as channel:
        stub = ps_pb2_grpc.ParameterServiceStub(channel)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            if what == "pull":
                request = ps_pb2.PullRequest(rank=1, incarnation=HUGE, min_version=HUGE, plan_digest=digest_of(server))
                list(stub.Pull(request, timeout=5, metadata=WORKER))
            else:
                block = ps_pb2.RowBlock(table="emb", ids=(3).to_bytes(8, "little"))
                request = ps_pb2.PullRowsRequest(rank=1, incarnation=HUGE, min_version=HUGE, blocks=[block])
                stub.PullRows(request, timeout=5, metadata=WORKER)
        assert time.monotonic() - started < ANSWER_SECONDS
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE, info.value.details()
    assert str(HUGE) in info.value.details()
    assert "version" in info.value.details()


def test_a_data_connection_call_ends_its_wait_when_its_worker_goes_away(start_cluster, wait_until) -> None:
    """A PushPullOnce on a data connection, with no deadline, waits for a sync round rank 1 never
    pushes; the worker closes its connection: the call's wait ends (and its thread with it)."""
    from ps_common import dataconn, frames
    from ps_worker.transport.encoding import Stamp, WireCodec
    from tests.helpers.data_connections import raw_connection

    (server,) = start_cluster(1, num_workers=2, mode="sync", data_port=0, lease_timeout=60)
    model = small_model()
    with PSClient([server.address], rank=0, num_workers=2, incarnation=1, timeout=10, data_path="grpc") as client:
        client.init(model, {"name": "sgd", "lr": 0.1}, init_timeout=20)
        plan = server.shard.plan
        codec = WireCodec(plan)
        flats = {k: p.detach().reshape(-1).clone().zero_() for k, p in model.named_parameters()}
        session = client.session.sessions[0]
        request = frames.build(
            codec.out_partitions(0, flats, False), codec.push_pull_head(Stamp(0, 1, 0, 0, session=session))
        )
        sock = raw_connection(server.data.port, rank=0, incarnation=1, session=session)
        assert dataconn.recv_struct(sock, dataconn.REPLY, time.monotonic() + 10) == (dataconn.MAGIC, 0)
        sock.sendall(b"".join(bytes(b) for b in dataconn.call(1, request, None)))  # no deadline
        wait_until(lambda: 0 in server.shard.rounds.pending, 10, "the call's push to be held for its round")
        sock.close()

        def ended() -> float:
            registry = server.metrics.registry
            labels = {"method": "ps.v1.ParameterService/PushPullOnce", "code": "DEADLINE_EXCEEDED"}
            return registry.get_sample_value("ps_rpc_duration_seconds_count", labels) or 0.0

        wait_until(ended, RELEASE_SECONDS, "the call's wait to end with its connection")
