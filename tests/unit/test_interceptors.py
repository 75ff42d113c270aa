"""The shard's interceptor (ps_server.service.chain) with its metrics stage on all four handler kinds,
with a fake context: no sockets."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from ps_proto.v1 import ps_pb2
from ps_server.membership.ranks import PushResult
from ps_server.metrics import ServerMetrics
from ps_server.service.call_metrics import CallMetrics
from ps_server.service.chain import Chain
from ps_server.service.rpc import push_response


class FakeContext:
    """The part of grpc.ServicerContext the interceptor reads; abort behaves like grpcio's."""

    def __init__(self, active: bool = True) -> None:
        self._code: grpc.StatusCode | None = None
        self.active = active

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def is_active(self) -> bool:
        return self.active

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code = code
        raise Exception()  # noqa: TRY002 - what grpcio raises


class Details:
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def wrap(
    handler: grpc.RpcMethodHandler, method: str, metrics: ServerMetrics | None = None
) -> tuple[grpc.RpcMethodHandler, ServerMetrics]:
    metrics = metrics or ServerMetrics(CollectorRegistry())
    wrapped = Chain(CallMetrics(metrics).wrap).intercept_service(lambda d: handler, Details(method))
    assert wrapped is not None
    return wrapped, metrics


def get(metrics: ServerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_unary_unary_records_duration_code_and_bytes() -> None:
    request = ps_pb2.JoinRequest(rank=1, num_workers=2, incarnation=3)
    reply = ps_pb2.JoinResponse(num_shards=2, version=7)
    handler, m = wrap(grpc.unary_unary_rpc_method_handler(lambda req, ctx: reply), "/ps.v1.ParameterService/Join")
    assert handler.unary_unary(request, FakeContext()) is reply
    method = "ps.v1.ParameterService/Join"
    assert get(m, "ps_rpc_duration_seconds_count", method=method, code="OK") == 1
    assert get(m, "ps_received_bytes_total", method=method) == request.ByteSize()
    assert get(m, "ps_sent_bytes_total", method=method) == reply.ByteSize()


def test_stream_unary_push_counts_pushes_staleness_and_refusals() -> None:
    """Accepted pushes reach the counters from the servicer's ShardCounters.pushed (as ParameterServicer
    tells them); the interceptor adds the bytes and the refusals by status code."""
    m = ServerMetrics(CollectorRegistry())
    results = iter([PushResult(4, staleness=3, mode="async"), PushResult(4, duplicate=True, mode="async")])

    def push(requests, ctx):
        for _ in requests:
            pass
        result = next(results)
        m.counters.pushed(result)  # as the servicer counts it
        return push_response(result)

    handler, m = wrap(grpc.stream_unary_rpc_method_handler(push), "/ps.v1.ParameterService/Push", m)
    msgs = [ps_pb2.PushRequest(header=ps_pb2.PushHeader(rank=1, clock=2)), ps_pb2.PushRequest()]
    handler.stream_unary(iter(msgs), FakeContext())
    handler.stream_unary(iter(msgs), FakeContext())  # a retried duplicate: not a new push
    assert get(m, "ps_pushes_total", mode="async") == 1
    assert get(m, "ps_push_staleness_count") == 1 and get(m, "ps_push_staleness_sum") == 3
    assert get(m, "ps_received_bytes_total", method="ps.v1.ParameterService/Push") == 2 * sum(
        x.ByteSize() for x in msgs
    )

    def stale(requests, ctx):
        ctx.abort(grpc.StatusCode.ABORTED, "too stale")

    handler, m = wrap(grpc.stream_unary_rpc_method_handler(stale), "/ps.v1.ParameterService/Push")
    with pytest.raises(Exception):  # noqa: B017 - grpcio's abort raises a bare Exception
        handler.stream_unary(iter(msgs), FakeContext())
    assert get(m, "ps_rejected_pushes_total", reason="stale") == 1
    assert get(m, "ps_rpc_duration_seconds_count", method="ps.v1.ParameterService/Push", code="ABORTED") == 1


def test_unary_stream_pull_records_wait_and_unknown_errors() -> None:
    parts = [ps_pb2.PullResponse(version=1, partition=ps_pb2.Partition(key="w", length=2, data=b"12345678"))] * 3
    handler, m = wrap(
        grpc.unary_stream_rpc_method_handler(lambda req, ctx: iter(parts)), "/ps.v1.ParameterService/Pull"
    )
    assert list(handler.unary_stream(ps_pb2.PullRequest(min_version=1), FakeContext())) == parts
    method = "ps.v1.ParameterService/Pull"
    assert get(m, "ps_sent_bytes_total", method=method) == 3 * parts[0].ByteSize()
    assert get(m, "ps_barrier_wait_seconds_count") == 1

    def broken(req, ctx):
        raise RuntimeError("bug")
        yield  # pragma: no cover

    handler, m = wrap(grpc.unary_stream_rpc_method_handler(broken), "/ps.v1.ParameterService/Pull")
    with pytest.raises(RuntimeError):
        list(handler.unary_stream(ps_pb2.PullRequest(), FakeContext()))
    assert get(m, "ps_rpc_duration_seconds_count", method=method, code="UNKNOWN") == 1
    assert get(m, "ps_barrier_wait_seconds_count") == 0  # no wait ended: the handler failed


def test_stream_stream_and_cancelled_stream() -> None:
    def echo(requests, ctx):
        yield from requests

    handler, m = wrap(grpc.stream_stream_rpc_method_handler(echo), "/grpc.reflection.v1alpha.ServerReflection/Info")
    msgs = [ps_pb2.GetStatusRequest(), ps_pb2.JoinRequest(rank=5)]
    assert list(handler.stream_stream(iter(msgs), FakeContext())) == msgs
    method = "grpc.reflection.v1alpha.ServerReflection/Info"
    assert get(m, "ps_rpc_duration_seconds_count", method=method, code="OK") == 1
    assert get(m, "ps_received_bytes_total", method=method) == get(m, "ps_sent_bytes_total", method=method) == 2

    stream = handler.stream_stream(iter(msgs * 3), FakeContext())
    next(stream)
    stream.close()  # what happens to the generator when the client goes away
    assert get(m, "ps_rpc_duration_seconds_count", method=method, code="CANCELLED") == 1


def test_a_stream_that_ends_because_the_client_went_away_is_cancelled() -> None:
    def watch(req, ctx):
        while ctx.is_active():  # as Admin/WatchStatus does
            ctx.active = False
            yield ps_pb2.WatchStatusResponse()

    handler, m = wrap(grpc.unary_stream_rpc_method_handler(watch), "/ps.v1.Admin/WatchStatus")
    assert len(list(handler.unary_stream(ps_pb2.WatchStatusRequest(), FakeContext()))) == 1
    assert get(m, "ps_rpc_duration_seconds_count", method="ps.v1.Admin/WatchStatus", code="CANCELLED") == 1
    assert get(m, "ps_rpc_duration_seconds_count", method="ps.v1.Admin/WatchStatus", code="OK") == 0


def test_client_gone_during_an_upload_is_cancelled_not_a_refusal() -> None:
    def push(requests, ctx):
        for _ in requests:
            raise grpc.RpcError()  # what the request iterator raises once the client cancelled

    handler, m = wrap(grpc.stream_unary_rpc_method_handler(push), "/ps.v1.ParameterService/Push")
    with pytest.raises(grpc.RpcError):
        handler.stream_unary(iter([ps_pb2.PushRequest()]), FakeContext(active=False))
    assert get(m, "ps_rpc_duration_seconds_count", method="ps.v1.ParameterService/Push", code="CANCELLED") == 1
    assert get(m, "ps_rejected_pushes_total", reason="cancelled") == 0


def test_unknown_methods_are_not_labelled() -> None:
    m = ServerMetrics(CollectorRegistry())
    assert Chain(CallMetrics(m).wrap).intercept_service(lambda d: None, Details("/x.Y/Z")) is None


def test_a_non_blocking_stream_stays_non_blocking_and_is_recorded_when_it_ends() -> None:
    """Health/Watch answers through a callback and holds no thread: the wrapper must keep that (else
    every watcher would hold a server thread) and record the call when the servicer sends None."""
    pool = futures.ThreadPoolExecutor(max_workers=1)
    answer = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
    callbacks: list = []

    def watch(request, ctx, send):
        callbacks.append(send)  # as grpc_health keeps it, to send later updates and the close
        send(answer)

    watch.experimental_non_blocking = True
    watch.experimental_thread_pool = pool
    handler, m = wrap(grpc.unary_stream_rpc_method_handler(watch), "/grpc.health.v1.Health/Watch")
    behavior = handler.unary_stream
    assert behavior.experimental_non_blocking and behavior.experimental_thread_pool is pool
    sent: list = []
    ctx = FakeContext()
    assert behavior(health_pb2.HealthCheckRequest(), ctx, sent.append) is None  # returns at once
    method = "grpc.health.v1.Health/Watch"
    assert sent == [answer] and get(m, "ps_rpc_duration_seconds_count", method=method, code="CANCELLED") == 0
    callbacks[0](answer)  # a later update
    ctx.active = False  # the client went away: the servicer's close callback sends None
    callbacks[0](None)
    callbacks[0](None)  # recorded once
    assert sent == [answer, answer, None, None]
    assert get(m, "ps_rpc_duration_seconds_count", method=method, code="CANCELLED") == 1
    assert get(m, "ps_sent_bytes_total", method=method) == 2 * answer.ByteSize()
    pool.shutdown()


def test_wrappers_keep_a_handler_s_own_thread_pool() -> None:
    pool = futures.ThreadPoolExecutor(max_workers=1)

    def status(request, ctx):
        yield ps_pb2.WatchStatusResponse()

    status.experimental_thread_pool = pool
    handler, m = wrap(grpc.unary_stream_rpc_method_handler(status), "/ps.v1.Admin/WatchStatus")
    assert handler.unary_stream.experimental_thread_pool is pool
    assert not getattr(handler.unary_stream, "experimental_non_blocking", False)
    assert len(list(handler.unary_stream(ps_pb2.WatchStatusRequest(), FakeContext()))) == 1
    assert get(m, "ps_rpc_duration_seconds_count", method="ps.v1.Admin/WatchStatus", code="OK") == 1
    pool.shutdown()
