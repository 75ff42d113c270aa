"""What arrives at a shard, sent by a hostile or unlucky client over real gRPC: plan bombs, endless
streams, huge and forged keys, undecodable bytes, an empty plan digest and wrapped integers.

Each refusal is fast, carries the contract's status code and a short message, changes nothing,
and leaves the shard serving.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_common import frames
from ps_common.plan import ParameterSpec, plan_digest
from ps_common.wire import plan_to_proto
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_worker import PSClient
from tests.conftest import RPC_TIMEOUT, small_model

SERVICE = "/ps.v1.ParameterService/"
SGD = ps_pb2.OptimizerSpec(name="sgd", kwargs={"lr": 0.1})
SHORT = 1024
"""Most characters a refusal's message may have."""


@pytest.fixture
def fresh(start_cluster):
    """One uninitialized shard (2 workers) and a channel to it."""
    (shard,) = start_cluster(1, num_workers=2)
    with grpc.insecure_channel(shard.address) as channel:
        yield shard, channel


@pytest.fixture
def live(start_cluster):
    """One initialized shard (2 workers), rank 0 joined through PSClient: (shard, channel, client)."""
    (shard,) = start_cluster(1, num_workers=2)
    client = PSClient([shard.address], rank=0, num_workers=2, incarnation=1, timeout=RPC_TIMEOUT)
    client.init(small_model(), {"name": "sgd", "lr": 0.1})
    with grpc.insecure_channel(shard.address) as channel:
        yield shard, channel, client
    client.close()


def fingerprint(shard) -> tuple:
    """Version, workers and every parameter byte of a shard."""
    view = shard.shard.status()
    store = shard.shard.store
    params = b"".join(t.numpy().tobytes() for t in store.tensors) if store else b""
    return view.initialized, view.version, tuple((w.clock, w.pushes) for w in view.workers), params


def serving(shard) -> bool:
    with grpc.insecure_channel(shard.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def refused(call, *args, timeout: float = RPC_TIMEOUT, **kwargs) -> grpc.RpcError:
    """The error of ``call(*args, **kwargs)``, which must fail."""
    with pytest.raises(grpc.RpcError) as err:
        result = call(*args, timeout=timeout, **kwargs)
        if isinstance(result, Iterator):
            list(result)
    return err.value


def init_header(specs: list[ParameterSpec], partition_bytes: int, digest: str | None = None) -> bytes:
    """An InitRequest carrying only a header declaring ``specs`` on one shard."""
    plan = ps_pb2.PlanInfo(
        specs=[ps_pb2.ParameterSpec(key=s.key, shape=s.shape, dtype=ps_pb2.DTYPE_FLOAT32) for s in specs],
        num_shards=1,
        partition_bytes=partition_bytes,
        digest=plan_digest(specs, 1, partition_bytes) if digest is None else digest,
    )
    header = ps_pb2.InitHeader(rank=0, incarnation=1, plan=plan, optimizer=SGD)
    return ps_pb2.InitRequest(header=header).SerializeToString()


# ------------------------------------------------------------------------------- plans too large to allocate
BOMB = [ParameterSpec("w", (10**12, 10**12), "float32")]


@pytest.mark.parametrize("initialized", [False, True], ids=["fresh", "initialized"])
def test_init_plan_bomb_is_refused_fast(start_cluster, initialized: bool) -> None:
    """Sixteen ~120-byte InitHeaders declaring [1e12, 1e12] in 1-byte partitions, and one header of
    a million keys, are refused in well under a second each; health still answers."""
    (shard,) = start_cluster(1, num_workers=2)
    if initialized:
        client = PSClient([shard.address], rank=0, num_workers=2, incarnation=1, timeout=RPC_TIMEOUT)
        client.init(small_model(), {"name": "sgd", "lr": 0.1})
        client.close()
    before = fingerprint(shard)
    bomb = init_header(BOMB, partition_bytes=1)
    assert len(bomb) < 160
    with grpc.insecure_channel(shard.address) as channel:
        init = channel.stream_unary(SERVICE + "Init")
        start = time.monotonic()
        with futures.ThreadPoolExecutor(16) as pool:
            errors = list(pool.map(lambda _: refused(init, iter([bomb])), range(16)))
        elapsed = time.monotonic() - start
        expected = grpc.StatusCode.FAILED_PRECONDITION if initialized else grpc.StatusCode.INVALID_ARGUMENT
        assert {e.code() for e in errors} == {expected}, errors[0].details()
        assert all(len(e.details()) < SHORT for e in errors)
        assert elapsed < 5.0, f"16 plan bombs took {elapsed:.1f} s"
        if not initialized:
            assert "--max-parameter-bytes" in errors[0].details()

        # a million one-element keys in one ~10 MB header
        spec = ps_pb2.ParameterSpec(key="k", shape=[1], dtype=ps_pb2.DTYPE_FLOAT32).SerializeToString()
        specs = frames.bytes_field(1, spec) * 1_000_000
        plan = specs + frames.uint_field(2, 1) + frames.uint_field(3, 4) + frames.bytes_field(4, b"0" * 64)
        header = frames.uint_field(2, 1) + frames.bytes_field(3, plan) + frames.bytes_field(4, SGD.SerializeToString())
        start = time.monotonic()
        err = refused(init, iter([frames.bytes_field(1, header)]))
        elapsed = time.monotonic() - start
        assert err.code() == expected, err.details()
        assert len(err.details()) < SHORT
        assert elapsed < 10.0, f"a million-key header took {elapsed:.1f} s"
    assert serving(shard)
    assert fingerprint(shard) == before


# ------------------------------------------------------------------------------- endless request streams
class Endless:
    """An endless request stream (bounded only by ``cap`` messages, as a safety net): ``first``
    messages, then ``repeat`` cycled; counts what gRPC took from it."""

    def __init__(self, first: list[bytes], repeat: list[bytes], cap: int = 2_000) -> None:
        self.first, self.repeat, self.cap = first, repeat, cap
        self.taken = 0
        self.bytes = 0

    def __iter__(self) -> Iterator[bytes]:
        for m in itertools.islice(itertools.chain(self.first, itertools.cycle(self.repeat)), self.cap):
            self.taken += 1
            self.bytes += len(m)
            yield m


def push_header(client: PSClient | None, **fields: object) -> bytes:
    digest = client.plan.digest if client is not None else "0" * 64
    if client is not None:  # the joined rank's session: a push header without it is refused before its partitions
        fields.setdefault("session", client.session.sessions[0])
    h = ps_pb2.PushHeader(rank=0, incarnation=1, clock=0, version=0, plan_digest=digest, **fields)
    return ps_pb2.PushRequest(header=h).SerializeToString()


def owned_partitions(client: PSClient) -> list[bytes]:
    return [
        frames.build([frames.OutPartition(p.key, p.offset, p.length, torch.ones(p.length))])
        for p in client.plan.owned_by(0)
    ]


STREAMS = {
    "Push": ("stream_unary", push_header),
    "PushPull": ("stream_stream", push_header),
    "Exchange": (
        "stream_stream",
        lambda client: ps_pb2.ExchangeRequest(
            header=ps_pb2.ExchangeHeader(rank=0, incarnation=1, clock=0, plan_digest=client.plan.digest)
        ).SerializeToString(),
    ),
    "Init": ("stream_unary", None),
}


def stream_call(channel: grpc.Channel, method: str):
    return getattr(channel, STREAMS[method][0])(SERVICE + method)


@pytest.mark.parametrize("method", sorted(STREAMS))
@pytest.mark.parametrize("attack", ["repeated partition", "junk bytes"])
def test_endless_streams_are_refused_after_about_the_plans_size(live, method: str, attack: str) -> None:
    """A stream that never ends (its partitions over and over, or each frame padded with an unknown
    field) is refused after about the plan's size, not buffered until the deadline."""
    shard, channel, client = live
    if method == "Init":
        plan = client.plan
        header = ps_pb2.InitHeader(rank=0, incarnation=1, plan=plan_to_proto(plan), optimizer=SGD)
        first = ps_pb2.InitRequest(header=header).SerializeToString()
    else:
        first = STREAMS[method][1](client)
    parts = owned_partitions(client)
    if attack == "junk bytes":  # each message: one partition, and 64 KiB the plan never asked for
        parts = [p + frames.bytes_field(15, b"\0" * 65536) for p in parts]
    before = fingerprint(shard)
    stream = Endless([first], parts)
    err = refused(stream_call(channel, method), iter(stream))
    assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), err.details()
    plan_bytes = shard.shard.status().parameter_bytes
    # gRPC's flow control lets the client run ahead a little; far from the 2,000 messages it has
    assert stream.taken < 200, (stream.taken, err.details())
    assert stream.bytes < 64 * (plan_bytes + 65536 + 4096), stream.bytes
    assert fingerprint(shard) == before
    assert serving(shard)


@pytest.mark.parametrize("method", ["Push", "PushPull", "Exchange"])
def test_not_initialized_is_refused_at_the_first_frame(fresh, method: str) -> None:
    shard, channel = fresh
    first = (
        push_header(None)
        if method != "Exchange"
        else ps_pb2.ExchangeRequest(
            header=ps_pb2.ExchangeHeader(rank=0, incarnation=1, plan_digest="0" * 64)
        ).SerializeToString()
    )
    part = frames.build([frames.OutPartition("w", 0, 1024, torch.ones(1024))])
    stream = Endless([first], [part])
    err = refused(stream_call(channel, method), iter(stream))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "must call Init" in err.details()
    assert stream.taken < 200, stream.taken


def test_push_pull_once_packed_with_tiny_partitions_is_refused_cheaply(live) -> None:
    """One 15 MiB PushPullOnce of ~1.3 million empty partitions: refused at the first one that is
    not this shard's (or repeated), not parsed whole."""
    shard, channel, client = live
    before = fingerprint(shard)
    p = client.plan.owned_by(0)[0]
    tiny = frames.bytes_field(2, ps_pb2.Partition(key=p.key, length=p.length, dtype=1).SerializeToString())
    header = ps_pb2.PushHeader(
        rank=0, incarnation=1, plan_digest=client.plan.digest, session=client.session.sessions[0]
    ).SerializeToString()
    message = frames.bytes_field(1, header) + tiny * ((15 << 20) // len(tiny))
    start = time.monotonic()
    err = refused(channel.unary_unary(SERVICE + "PushPullOnce"), message)
    elapsed = time.monotonic() - start
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert elapsed < 5.0, f"refusing a packed PushPullOnce took {elapsed:.1f} s"
    assert fingerprint(shard) == before
    assert serving(shard)


# ------------------------------------------------------------------------------- huge keys
def test_huge_keys_get_a_short_invalid_argument(fresh, live) -> None:
    """A 1 MiB key at Init, and one in a push, are INVALID_ARGUMENT with a short message."""
    shard, channel = fresh
    huge = "k" * (1 << 20)
    err = refused(
        channel.stream_unary(SERVICE + "Init"), iter([init_header([ParameterSpec(huge, (2,), "float32")], 64)])
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details()[:200])
    assert len(err.details()) < SHORT and "key" in err.details()
    assert not shard.shard.status().initialized

    shard, channel, client = live
    before = fingerprint(shard)
    part = frames.build([frames.OutPartition(huge, 0, 1, torch.ones(1))])
    err = refused(channel.stream_unary(SERVICE + "Push"), iter([push_header(client), part]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details()[:200])
    assert len(err.details()) < SHORT
    assert fingerprint(shard) == before


def test_a_key_with_a_newline_cannot_forge_a_log_line(live, caplog) -> None:
    shard, channel, client = live
    forged = "0.weight\n2026-01-01 00:00:00 INFO shard 0: rank 1 joined"
    for values in (torch.ones(1), torch.full((1,), float("nan"))):
        part = frames.build([frames.OutPartition(forged, 0, 1, values)])
        with caplog.at_level(logging.INFO):
            err = refused(channel.stream_unary(SERVICE + "Push"), iter([push_header(client), part]))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "\n" not in err.details() and "\\n" in err.details(), err.details()
    messages = [r.getMessage() for r in caplog.records]
    assert any("\\n2026" in m for m in messages), messages
    assert not any("\n" in m for m in messages), messages


# ------------------------------------------------------------------------------- every method with bad bytes
UNARY = {
    "ps.v1.ParameterService/Join": "unary_unary",
    "ps.v1.ParameterService/Heartbeat": "unary_unary",
    "ps.v1.ParameterService/Leave": "unary_unary",
    "ps.v1.ParameterService/Init": "stream_unary",
    "ps.v1.Admin/GetStatus": "unary_unary",
    "ps.v1.Admin/WatchStatus": "unary_stream",
    "ps.v1.Admin/UpdateConfig": "unary_unary",
    "ps.v1.Admin/Checkpoint": "unary_unary",
    "ps.v1.Admin/EvictWorker": "unary_unary",
    "grpc.health.v1.Health/Check": "unary_unary",
    "grpc.health.v1.Health/Watch": "unary_stream",
    "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": "stream_stream",
}
GARBAGE = b"\xff\xff\xff\x0f garbage"


@pytest.mark.parametrize("method", sorted(UNARY))
def test_undecodable_bytes_are_invalid_argument_without_a_traceback(live, method: str, caplog) -> None:
    shard, channel, _ = live
    before = fingerprint(shard)
    kind = UNARY[method]
    call = getattr(channel, kind)("/" + method)
    with caplog.at_level(logging.DEBUG):
        err = refused(call, iter([GARBAGE]) if kind.startswith("stream") else GARBAGE)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert len(err.details()) < 200
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    assert fingerprint(shard) == before
    assert serving(shard)


# ------------------------------------------------------------------------------- an empty plan digest
def test_an_empty_plan_digest_is_refused_on_every_data_rpc(live) -> None:
    shard, channel, client = live
    before = fingerprint(shard)
    parts = owned_partitions(client)
    header = ps_pb2.PushHeader(rank=0, incarnation=1)
    calls = {
        "Push": lambda: channel.stream_unary(SERVICE + "Push")(
            iter([ps_pb2.PushRequest(header=header).SerializeToString(), *parts]), timeout=RPC_TIMEOUT
        ),
        "Pull": lambda: list(
            channel.unary_stream(SERVICE + "Pull")(
                ps_pb2.PullRequest(rank=0, incarnation=1).SerializeToString(), timeout=RPC_TIMEOUT
            )
        ),
        "PushPull": lambda: list(
            channel.stream_stream(SERVICE + "PushPull")(
                iter([frames.bytes_field(1, header.SerializeToString()), *parts]), timeout=RPC_TIMEOUT
            )
        ),
        "PushPullOnce": lambda: channel.unary_unary(SERVICE + "PushPullOnce")(
            frames.bytes_field(1, header.SerializeToString()) + b"".join(parts), timeout=RPC_TIMEOUT
        ),
        "Exchange": lambda: list(
            channel.stream_stream(SERVICE + "Exchange")(
                iter([ps_pb2.ExchangeRequest(header=ps_pb2.ExchangeHeader(rank=0, incarnation=1)).SerializeToString()]),
                timeout=RPC_TIMEOUT,
            )
        ),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.value.details())
        assert "plan_digest" in err.value.details(), (name, err.value.details())
    assert fingerprint(shard) == before
    # a real worker always sends the digest: its push and pull are served
    assert client.push({s.key: torch.zeros(s.shape) for s in client.plan.specs})[0].version == 0
    assert client.pull({s.key: torch.zeros(s.shape) for s in client.plan.specs}, min_version=0) == 0


def varint_field(field: int, value: int) -> bytes:
    """A varint field holding ``value`` as a protobuf encoder writes a negative int64 (10 bytes)."""
    return frames.tag(field, frames.VARINT) + frames.varint(value & (2**64 - 1))


@pytest.mark.parametrize(
    ("field", "value", "what"),
    [
        (7, -5, "staleness"),
        (9, -5, "communication_period"),
        (3, -1, "sync_quorum"),
        (5, -5, "max_staleness"),
        (4, float("nan"), "round_timeout"),
        (4, float("inf"), "round_timeout"),
        (4, -1.0, "round_timeout"),
        (8, float("nan"), "moving_rate"),
    ],
)
def test_raw_update_config_is_validated(live, field: int, value: float, what: str) -> None:
    """Values a typed client cannot send (a uint32 of -5 arrives as 4294967291) are refused."""
    shard, channel, _ = live
    settings = shard.shard.settings
    if isinstance(value, float):
        raw = frames.tag(field, frames.I64) + torch.tensor([value], dtype=torch.float64).numpy().tobytes()
    else:
        raw = varint_field(field, value)
    err = refused(channel.unary_unary("/ps.v1.Admin/UpdateConfig"), raw)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert what.replace("_", "-") in err.details() or what in err.details(), err.details()
    assert shard.shard.settings == settings


def test_update_config_keeps_serving_after_refusals(live) -> None:
    shard, channel, _ = live
    stub = ps_pb2_grpc.AdminStub(channel)
    reply = stub.UpdateConfig(ps_pb2.UpdateConfigRequest(staleness=3), timeout=RPC_TIMEOUT)
    assert reply.config.staleness == 3


def test_on_a_token_protected_shard_the_token_is_checked_first(start_cluster) -> None:
    (shard,) = start_cluster(1, num_workers=1, token="worker-secret", admin_token="admin-secret")
    with grpc.insecure_channel(shard.address) as channel:
        call = channel.unary_unary("/ps.v1.Admin/GetStatus")
        assert refused(call, GARBAGE).code() == grpc.StatusCode.UNAUTHENTICATED
        err = refused(call, GARBAGE, metadata=(("authorization", "Bearer admin-secret"),))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        join = channel.unary_unary(SERVICE + "Join")
        err = refused(join, GARBAGE, metadata=(("authorization", "Bearer worker-secret"),))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert serving(shard)
