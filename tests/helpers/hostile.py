"""Hostile clients for the soak (``tests/chaos/test_hostile_soak.py``): each attack is one bounded
action against a live shard that holds only the worker token, as a buggy or malicious worker would.

Every attack ends by itself: a call it holds open is cancelled after ``hold`` seconds, every
deadline is finite, and a data connection is closed. An attack returns the status code name it met
("OK" when the shard accepted it, "held" when it was still waiting when cancelled); the soak counts
them. None of them may change the job: the job's final parameters must be the same bits as without
them.
"""

from __future__ import annotations

import hashlib
import hmac
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from ps_common import dataconn
from ps_proto.v1 import ps_pb2, ps_pb2_grpc

HUGE = 2**63 - 1
"""A version, incarnation or clock no real job reaches."""
HOUR = 3600.0
"""The deadline of a 'long' waiting call: the test cancels it long before."""
CALL_TIMEOUT = 5.0
"""The deadline of a call that should be answered at once."""


@dataclass
class Target:
    """One shard as the attacker sees it."""

    address: str
    data_port: int
    token: str

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)


def _held(call: grpc.Future, hold: float, stop: threading.Event) -> str:
    """Wait up to ``hold`` s for ``call``'s end; cancel it if it is still running. Returns its code."""
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not call.done() and not stop.is_set():
        time.sleep(0.05)  # the attacker's own pace: holding a call open, not a synchronization
    if not call.done():
        call.cancel()
        return "held"
    try:
        call.result()
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name
    except grpc.FutureCancelledError:
        return "held"


def _read_held(call: grpc.Call, hold: float) -> str:
    """Read the response stream ``call`` for up to ``hold`` s; cancel it if it is still open. Returns
    its code's name ("held" when it was still open)."""
    result: list[str] = []

    def read() -> None:
        try:
            for _ in call:
                pass
            result.append("OK")
        except grpc.RpcError as exc:
            result.append("held" if exc.code() == grpc.StatusCode.CANCELLED else exc.code().name)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(hold)
    if reader.is_alive():
        call.cancel()
        reader.join(CALL_TIMEOUT)
    return result[0] if result else "held"


def waiting_pull(channel: grpc.Channel, t: Target, rng: random.Random, hold: float, stop: threading.Event) -> str:
    """A Pull of an unreachable version (no real incarnation), held open then cancelled."""
    stub = ps_pb2_grpc.ParameterServiceStub(channel)
    request = ps_pb2.PullRequest(
        rank=rng.randrange(2), incarnation=HUGE, min_version=rng.choice([HUGE, 10**6]), plan_digest="0" * 64
    )
    return _read_held(stub.Pull(request, timeout=HOUR, metadata=t.metadata), hold)


def waiting_pull_rows(channel: grpc.Channel, t: Target, rng: random.Random, hold: float, stop: threading.Event) -> str:
    """A PullRows of an unreachable table version, held open then cancelled."""
    stub = ps_pb2_grpc.ParameterServiceStub(channel)
    request = ps_pb2.PullRowsRequest(
        rank=rng.randrange(2),
        incarnation=HUGE,
        min_version=HUGE,
        blocks=[ps_pb2.RowBlock(table="emb.weight", ids=struct.pack("<q", 1))],
    )
    return _held(stub.PullRows.future(request, timeout=HOUR, metadata=t.metadata), hold, stop)


def waiting_init_tables(
    channel: grpc.Channel, t: Target, rng: random.Random, hold: float, stop: threading.Event
) -> str:
    """InitTables from a rank other than 0 before any table exists (it would wait for rank 0)."""
    stub = ps_pb2_grpc.ParameterServiceStub(channel)
    spec = ps_pb2.TableSpec(name="emb.weight", num_rows=1000, dim=8, dtype=ps_pb2.DTYPE_FLOAT32)
    request = ps_pb2.InitTablesRequest(rank=1, incarnation=HUGE, tables=[spec])
    return _held(stub.InitTables.future(request, timeout=HOUR, metadata=t.metadata), hold, stop)


def header_only_push_pull(
    channel: grpc.Channel, t: Target, rng: random.Random, hold: float, stop: threading.Event
) -> str:
    """A PushPull stream that sends its header and then nothing, held open then cancelled."""
    stub = ps_pb2_grpc.ParameterServiceStub(channel)
    release = threading.Event()
    header = ps_pb2.PushHeader(rank=rng.randrange(2), incarnation=HUGE, clock=HUGE, plan_digest="0" * 64)

    def requests():
        yield ps_pb2.PushPullRequest(header=header)
        release.wait(hold)  # bounded: the stream's requests end after ``hold`` s

    try:
        return _read_held(stub.PushPull(requests(), timeout=HOUR, metadata=t.metadata), hold)
    finally:
        release.set()


def table_bomb(channel: grpc.Channel, t: Target, rng: random.Random, hold: float, stop: threading.Event) -> str:
    """Declare a wide adam table as a 'rank 0' that is not a member, then push one row to it."""
    stub = ps_pb2_grpc.ParameterServiceStub(channel)
    name = f"bomb{rng.randrange(4)}.weight"
    spec = ps_pb2.TableSpec(
        name=name,
        num_rows=2**40,
        dim=65536,
        dtype=ps_pb2.DTYPE_FLOAT32,
        init_std=0.01,
        optimizer=ps_pb2.OptimizerSpec(name="adam", kwargs={"lr": 0.01}),
    )
    codes = []
    for call in (
        lambda: stub.InitTables(
            ps_pb2.InitTablesRequest(rank=0, incarnation=HUGE, tables=[spec]), timeout=CALL_TIMEOUT, metadata=t.metadata
        ),
        lambda: stub.PushRows(
            ps_pb2.PushRowsRequest(
                rank=0,
                incarnation=HUGE,
                clock=0,
                blocks=[ps_pb2.RowBlock(table=name, ids=struct.pack("<q", rng.randrange(2**40)), data=bytes(262144))],
            ),
            timeout=CALL_TIMEOUT,
            metadata=t.metadata,
        ),
    ):
        try:
            call()
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)
    return "+".join(codes)


def parked_frame(channel: grpc.Channel, t: Target, rng: random.Random, hold: float, stop: threading.Event) -> str:
    """A data connection claiming a rank that is not a member, sending one frame's first record and
    part of its bytes, held open then closed."""
    if not t.data_port:
        return "no-data-port"
    host = t.address.rsplit(":", 1)[0]
    try:
        sock = socket.create_connection((host, t.data_port), timeout=CALL_TIMEOUT)
    except OSError as exc:
        return type(exc).__name__
    try:
        sock.settimeout(CALL_TIMEOUT)
        sock.sendall(dataconn.hello(100 + rng.randrange(16), HUGE, t.token))
        size = 1 << 20
        sock.sendall(dataconn.RECORD.pack(1, 0, ps_pb2.DTYPE_FLOAT32, size) + bytes(size // 2))
        sock.settimeout(hold)
        try:
            got = sock.recv(4096)
        except TimeoutError:
            return "held"
        if len(got) >= dataconn.REPLY.size:
            magic, status = dataconn.REPLY.unpack_from(got)
            return "accepted" if magic == dataconn.MAGIC and status == 0 else f"refused ({status})"
        return "closed"
    except OSError as exc:
        return type(exc).__name__
    finally:
        sock.close()


def forged_record(
    key: str, cluster: str
) -> Callable[[grpc.Channel, Target, random.Random, float, threading.Event], str]:
    """A Heartbeat relaying a membership record that shrinks the job to one worker and sets the lr to
    5.0, signed with ``key`` (an earlier job's admin token, or a guess) for cluster ``cluster``."""

    def attack(channel: grpc.Channel, t: Target, rng: random.Random, hold: float, stop: threading.Event) -> str:
        stub = ps_pb2_grpc.ParameterServiceStub(channel)
        record = ps_pb2.MembershipEpoch(
            epoch=10**6 + rng.randrange(1000),
            num_workers=1,
            previous_num_workers=2,
            configured_num_workers=2,
            members=[ps_pb2.EpochMember(rank=0, state=ps_pb2.WORKER_STATE_LIVE, incarnation=1)],
            config_changes=[
                ps_pb2.ConfigChange(version=0, epoch=10**6, update=ps_pb2.UpdateConfigRequest(learning_rate=5.0))
            ],
            reason="forged",
        )
        sign_record(record, key, cluster)
        request = ps_pb2.HeartbeatRequest(
            rank=rng.randrange(2), incarnation=rng.choice([1, HUGE]), membership_epoch=record.epoch, membership=record
        )
        try:
            stub.Heartbeat(request, timeout=CALL_TIMEOUT, metadata=t.metadata)
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name

    return attack


def sign_record(record: ps_pb2.MembershipEpoch, key: str, cluster: str) -> None:
    """Sign ``record`` as a shard 0 holding admin token ``key`` would (HMAC-SHA256 over the record
    without its signature), for cluster ``cluster`` when records carry one."""
    if "cluster_id" in ps_pb2.MembershipEpoch.DESCRIPTOR.fields_by_name:
        record.cluster_id = cluster
    record.ClearField("signature")
    record.signature = hmac.new(key.encode(), record.SerializeToString(deterministic=True), hashlib.sha256).digest()


def unauthorized_resize(
    channel: grpc.Channel, t: Target, rng: random.Random, hold: float, stop: threading.Event
) -> str:
    """Admin/Resize with the worker token, or with none."""
    stub = ps_pb2_grpc.AdminStub(channel)
    metadata = t.metadata if rng.random() < 0.5 else ()
    try:
        stub.Resize(ps_pb2.ResizeRequest(num_workers=rng.choice([1, 3, 64])), timeout=CALL_TIMEOUT, metadata=metadata)
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name
