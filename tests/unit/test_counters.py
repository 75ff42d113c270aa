"""One set of counters per shard: Admin/GetStatus and Prometheus read the same numbers. No sockets:
a real shard, the metrics interceptor around fake handlers, a fresh registry."""

from __future__ import annotations

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from ps_common.errors import NonFiniteUpdateError, ReplayedPushError, StalePushError
from ps_common.modes import ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_common.partition import WirePartition
from ps_common.plan import ParameterSpec, make_plan
from ps_server.membership.ranks import PushResult
from ps_server.metrics import REFUSAL_REASONS, STALENESS_BUCKETS, ServerMetrics
from ps_server.service.admin import status_to_proto
from ps_server.service.call_metrics import CallMetrics
from ps_server.service.chain import Chain
from ps_server.shard.counters import RECEIVED_METHODS, SENT_METHODS, ShardCounters
from ps_server.shard.shard import PushStamp, Shard
from tests.helpers.tensors import encode

PLAN = make_plan([ParameterSpec("w", (3,), "float32")], 1)
PUSH = "ps.v1.ParameterService/Push"


def wire(x: float) -> list[WirePartition]:
    return [WirePartition("w", 0, 3, "float32", encode(torch.full((3,), x)))]


class Context:
    """The part of grpc.ServicerContext the interceptor reads."""

    def __init__(self) -> None:
        self._code: grpc.StatusCode | None = None

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def is_active(self) -> bool:
        return True

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code = code
        raise Exception(details)  # noqa: TRY002 - what grpcio raises


class Details:
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def sample(metrics: ServerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_duplicate_push_counts_once_and_bytes_are_by_method() -> None:
    counters = ShardCounters()
    counters.pushed(PushResult(3, staleness=2, mode="async"))
    counters.pushed(PushResult(3, staleness=2, duplicate=True, mode="async"))
    counters.transferred(PUSH, received=10, sent=4)
    counters.transferred("ps.v1.ParameterService/Join", received=7)
    counters.transferred("ps.v1.ParameterService/Pull", received=3, sent=20)
    view = counters.view()
    assert view.pushes == {"async": 1} and view.staleness == {2: 1}
    assert view.data_bytes() == (10, 20)  # Join is not data traffic; a Pull's request, a Push's answer neither
    assert PUSH in RECEIVED_METHODS and PUSH not in SENT_METHODS


def test_getstatus_and_prometheus_read_the_same_numbers_after_a_mix_of_refusals() -> None:
    shard = Shard(0, 1, ModeSettings("async", num_workers=2, max_staleness=1))
    metrics = ServerMetrics(CollectorRegistry(), shard.status, shard.counters)
    for r in range(2):
        shard.join(r, 2, 1)
    shard.init(PLAN.specs, 1, PLAN.partition_bytes, PLAN.digest, OptimizerSpec("sgd", {"lr": 1.0}), wire(0.0))

    def push(rank: int, clock: int, grad_version: int, x: float = 1.0) -> None:
        shard.counters.pushed(shard.push(PushStamp(rank, 1, clock), grad_version, PLAN, wire(x)))

    for clock in range(3):
        push(0, clock, clock)  # versions 1..3, staleness 0
    push(1, 0, 2)  # staleness 1
    with pytest.raises(StalePushError):
        push(1, 1, 0)  # 4 versions stale: refused, counted "stale" by the shard
    for clock in range(1, 70):  # the shard remembers the answers of the last 64 clocks only
        push(1, clock, shard.version)
    with pytest.raises(ReplayedPushError):
        push(1, 2, shard.version)  # applied, and too old to be answered again: "replayed"
    push(0, 3, shard.version, 3e38)
    with pytest.raises(NonFiniteUpdateError):
        push(0, 4, shard.version, 3e38)  # w would overflow: "non_finite_update"

    def bad(requests, context):  # a refusal the shard never sees, by status code (the interceptor's)
        for _ in requests:
            pass
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad")

    handler = Chain(CallMetrics(metrics).wrap).intercept_service(
        lambda d: grpc.stream_unary_rpc_method_handler(bad), Details(f"/{PUSH}")
    )
    assert handler is not None
    with pytest.raises(Exception, match="bad"):
        handler.stream_unary(iter([b"12345"]), Context())

    status = status_to_proto(shard.status(), shard.counters, 1.0)
    exported = {
        x.labels["reason"]: x.value
        for family in metrics.registry.collect()
        if family.name == "ps_rejected_pushes"
        for x in family.samples
        if x.name == "ps_rejected_pushes_total"
    }
    assert dict(status.rejected_pushes) == {r: n for r, n in exported.items() if n}  # GetStatus: non-zero only
    assert set(REFUSAL_REASONS) <= set(exported)  # the shard's own reasons from the start, zeros included
    assert {"stale", "replayed", "non_finite_update", "invalid_argument"} <= set(status.rejected_pushes)
    assert status.rejected_pushes["invalid_argument"] == 1
    assert status.staleness.count == sample(metrics, "ps_push_staleness_count") == shard.counters.view().pushes["async"]
    assert status.staleness.max == max(shard.counters.view().staleness)
    assert sample(metrics, "ps_push_staleness_bucket", le=str(float(STALENESS_BUCKETS[0]))) == sum(
        n for v, n in shard.counters.view().staleness.items() if v == 0
    )
    assert status.received_bytes == sum(sample(metrics, "ps_received_bytes_total", method=m) for m in RECEIVED_METHODS)
    assert status.received_bytes == 5
