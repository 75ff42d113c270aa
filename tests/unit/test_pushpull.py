"""ps_worker.transport.pushpull and .calls against a fake transport: a step's PushPull stamps, accounts and
times through the session, and a push refused as too stale is followed by a pull (no sockets)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from ps_common import frames
from ps_common.plan import ParameterSpec, make_plan
from ps_proto.v1 import ps_pb2
from ps_worker.metrics import WorkerMetrics
from ps_worker.planning import model_specs
from ps_worker.session import Session
from ps_worker.staging import HostStaging
from ps_worker.transport.calls import ShardCalls
from ps_worker.transport.encoding import WireCodec
from ps_worker.transport.pushpull import PendingPushPull
from ps_worker.transport.retry import CallPolicy

PARAMS = {"w": torch.zeros(4), "b": torch.zeros(2)}
PLAN = make_plan(model_specs(list(PARAMS.items())), 1)


class Stale(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.ABORTED

    def details(self) -> str:
        return "too stale"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("ps-reason", "STALE"),)


class FakeShard:
    """One shard: answers PushPullOnce with ``weights`` at ``version`` (or refuses), and Pull alike."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.version = 3
        self.weights = {"w": torch.arange(4.0), "b": torch.tensor([5.0, 6.0])}
        self.headers: list[ps_pb2.PushHeader] = []

    def frames(self, answer: bytes = b"") -> bytes:
        outs = [
            frames.OutPartition(p.key, p.offset, p.length, self.weights[p.key][p.offset : p.offset + p.length])
            for p in PLAN.owned_by(0)
        ]
        return frames.build(outs, frames.uint_field(1, self.version) + frames.bytes_field(3, answer))

    def push_pull_once(self, request: bytes, **kwargs: Any) -> bytes:
        self.headers.append(ps_pb2.PushPullRequest.FromString(request).header)
        if self.refuse:
            raise Stale()
        self.version += 1
        return self.frames(ps_pb2.PushResponse(version=self.version, staleness=2).SerializeToString())

    def pull(self, request: ps_pb2.PullRequest, **kwargs: Any) -> Iterator[bytes]:
        return iter([self.frames()])


class FakeTransport:
    def __init__(self, shard: FakeShard) -> None:
        self.servers, self.timeout, self.retry_deadline, self.metadata = ["h:0"], 1.0, 1.0, ()
        self.push_pull_once, self.pull_calls = [shard.push_pull_once], [shard.pull]
        self.sent_bytes = 0

    num_shards = 1

    def each_shard(self, fn: Callable[[int], Any]) -> list[Any]:
        return [fn(0)]

    policy = CallPolicy(0.0)  # no time to retry in: a transient failure is raised

    def call(self, fn: Callable[[], Any], what: str) -> Any:
        return fn()

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def sent(self, msg: bytes) -> bytes:
        self.sent_bytes += len(msg)
        return msg

    def received(self, nbytes: int) -> None:
        pass

    def data_connection(self, k: int, rank: int, incarnation: int, session: int = 0) -> None:
        return None  # the shard offers no data connection: PushPullOnce on gRPC


def client_parts(shard: FakeShard) -> tuple[ShardCalls, Session, CollectorRegistry]:
    registry = CollectorRegistry()
    t = FakeTransport(shard)
    session = Session(t, rank=0, num_workers=1, incarnation=5)  # type: ignore[arg-type]
    path = ShardCalls(t, session, HostStaging(), WorkerMetrics(registry))  # type: ignore[arg-type]
    path.codec = WireCodec(PLAN)
    return path, session, registry


def test_a_step_is_stamped_accounted_and_timed_through_the_session() -> None:
    shard = FakeShard()
    path, session, registry = client_parts(shard)
    session.clock = 7
    out = {k: torch.zeros_like(v) for k, v in PARAMS.items()}
    # one message: PushPullOnce in finish(), no stream
    step = PendingPushPull(path, out, stream=True, hyperparameters=[{"lr": 0.5}])
    step.ready("w", torch.ones(4))
    assert step.finish() == 4  # "b" had no gradient: zeros went
    (header,) = shard.headers
    assert (header.rank, header.incarnation, header.clock, header.groups[0].values["lr"]) == (0, 5, 7, 0.5)
    assert torch.equal(out["w"], shard.weights["w"]) and torch.equal(out["b"], shard.weights["b"])
    assert session.clock == 8 and session.version == 4 and session.staleness[2] == 1
    assert session.pushed_bytes == path.transport.sent_bytes > 0  # type: ignore[attr-defined]
    assert registry.get_sample_value("ps_worker_push_pull_duration_seconds_count") == 1
    assert registry.get_sample_value("ps_worker_push_duration_seconds_count") == 0


def test_a_push_refused_as_too_stale_counts_the_step_and_pulls() -> None:
    shard = FakeShard(refuse=True)
    path, session, registry = client_parts(shard)
    out = {k: torch.zeros_like(v) for k, v in PARAMS.items()}
    step = PendingPushPull(path, out, stream=False)
    assert step.finish() == 3
    assert session.refused_pushes == 1 and session.clock == 1 and torch.equal(out["w"], shard.weights["w"])
    assert registry.get_sample_value("ps_worker_pull_duration_seconds_count") == 1


def test_nothing_goes_before_init() -> None:
    path, _, _ = client_parts(FakeShard())
    path.codec = None
    with pytest.raises(RuntimeError, match="Call client.init"):
        PendingPushPull(path, dict(PARAMS), stream=False)


def test_a_worker_follows_the_plan_an_earlier_release_cut_and_nothing_else() -> None:
    path, session, _ = client_parts(FakeShard())
    specs = [ParameterSpec("w", (9216, 128), "float32"), ParameterSpec("b", (128,), "float32")]
    ours = WireCodec(make_plan(specs, 2))
    earlier = make_plan(specs, 2, cut=1)  # restored from a checkpoint of an earlier release
    assert earlier.partitions != ours.plan.partitions
    followed = path.follow_plan(ours, earlier.digest)
    assert followed.plan == earlier and path.codec is followed and session.plan_digest == earlier.digest
    assert path.follow_plan(ours, ours.plan.digest) is ours
    assert path.follow_plan(ours, "") is ours  # the shards are not initialized yet
    assert path.follow_plan(ours, "f" * 64) is ours  # another model: the shards refuse it at the first request
