"""The shard's one interceptor (ps_server.service.chain) with its real stages and fake calls: the order
of the checks, what a refusal takes, and the handlers built once per method. No sockets."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from ps_proto.v1 import ps_pb2
from ps_server.metrics import ServerMetrics
from ps_server.service.auth import TokenCheck
from ps_server.service.call_metrics import CallMetrics
from ps_server.service.chain import Chain
from ps_server.service.decoding import Decoding, lenient
from ps_server.service.rank_tokens import RANK, Caller, RankTokens
from ps_server.service.streams import WATCH, StreamLimit, StreamLimits
from ps_server.service.waiting_calls import WaitingCalls


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self) -> None:
        self._code: grpc.StatusCode | None = None
        self.details = ""
        self.metadata: tuple[tuple[str, str], ...] = ()

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def is_active(self) -> bool:
        return True

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return True

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.metadata = tuple(metadata)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self.details = code, details
        raise Aborted(details)


class Details:
    def __init__(self, method: str, token: str | None = None) -> None:
        self.method = method
        self.invocation_metadata = (("authorization", f"Bearer {token}"),) if token else ()


class Shard:
    """A chain as the server builds it (tracing off), over fake servicer methods."""

    def __init__(self, pool: futures.ThreadPoolExecutor, rank_tokens: RankTokens | None = None) -> None:
        self.metrics = ServerMetrics(CollectorRegistry())
        self.refused: list[Any] = []
        self.tokens = TokenCheck("worker", "admin", on_refused=self.refused.append, rank_tokens=rank_tokens)
        self.streams = StreamLimits({WATCH: StreamLimit(1, "watch streams", "--max-watch-streams")}, pool)
        self.waiting = WaitingCalls(1, pool)
        decoding = Decoding(on_refused=lambda: self.refused.append("decoding"))
        stages = [self.streams.wrap, self.waiting.wrap, decoding.wrap]
        self.chain = Chain(CallMetrics(self.metrics).wrap, stages, admit=self.tokens.admit, deserializer=lenient)

    def handler(self, method: str, handler: grpc.RpcMethodHandler, token: str | None) -> grpc.RpcMethodHandler:
        result = self.chain.intercept_service(lambda details: handler, Details(method, token))
        assert result is not None
        return result

    def count(self, method: str, code: str) -> float:
        labels = {"method": method.lstrip("/"), "code": code}
        return self.metrics.registry.get_sample_value("ps_rpc_duration_seconds_count", labels) or 0.0


@pytest.fixture
def pool() -> Iterator[futures.ThreadPoolExecutor]:
    executor = futures.ThreadPoolExecutor(1)
    yield executor
    executor.shutdown(wait=False)


PULL_ROWS = "/ps.v1.ParameterService/PullRows"
WATCH_STATUS = "/ps.v1.Admin/WatchStatus"


def pull_rows_handler(seen: list[Any]) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(
        lambda request, context: seen.append((request, getattr(context, "caller", None))) or "rows",
        request_deserializer=ps_pb2.PullRowsRequest.FromString,
    )


def test_a_refused_token_is_recorded_and_takes_no_waiting_slot_nor_reads_the_request(pool) -> None:
    shard, seen = Shard(pool), []
    handler = shard.handler(PULL_ROWS, pull_rows_handler(seen), token="wrong")
    assert handler.request_deserializer is None  # a refusal answers before it reads
    context = FakeContext()
    with pytest.raises(Aborted):
        handler.unary_unary(b"\xff not a message", context)
    assert context.code() == grpc.StatusCode.UNAUTHENTICATED and "is wrong" in context.details
    assert shard.refused == [grpc.StatusCode.UNAUTHENTICATED] and shard.waiting.open == 0 and seen == []
    assert shard.count(PULL_ROWS, "UNAUTHENTICATED") == 1


def test_an_admitted_call_runs_in_the_waits_pool_and_its_undecodable_request_is_refused_innermost(pool) -> None:
    shard, seen = Shard(pool), []
    handler = shard.handler(PULL_ROWS, pull_rows_handler(seen), token="worker")
    assert handler.unary_unary.experimental_thread_pool is pool
    request = handler.request_deserializer(b"\xff not a message")  # lenient: no exception
    context = FakeContext()
    with pytest.raises(Aborted):
        handler.unary_unary(request, context)
    assert context.code() == grpc.StatusCode.INVALID_ARGUMENT and shard.refused == ["decoding"]
    assert shard.waiting.open == 0 and seen == []  # its slot was taken, then freed
    assert shard.count(PULL_ROWS, "INVALID_ARGUMENT") == 1
    good = ps_pb2.PullRowsRequest()
    assert handler.unary_unary(handler.request_deserializer(good.SerializeToString()), FakeContext()) == "rows"
    assert seen == [(good, None)] and shard.count(PULL_ROWS, "OK") == 1


def test_a_watch_stream_refused_by_its_token_takes_no_slot(pool) -> None:
    shard = Shard(pool)

    def watch(request: Any, context: Any) -> Iterator[str]:
        yield "status"

    handler = grpc.unary_stream_rpc_method_handler(watch)
    with pytest.raises(Aborted):
        list(shard.handler(WATCH_STATUS, handler, token="worker").unary_stream("req", FakeContext()))
    assert shard.refused == [grpc.StatusCode.PERMISSION_DENIED] and shard.streams.limits[WATCH].open == 0
    admitted = shard.handler(WATCH_STATUS, handler, token="admin").unary_stream
    assert admitted.experimental_thread_pool is pool and list(admitted("req", FakeContext())) == ["status"]
    assert shard.count(WATCH_STATUS, "PERMISSION_DENIED") == 1 and shard.count(WATCH_STATUS, "OK") == 1


def test_each_method_and_outcome_is_built_once(pool) -> None:
    shard, seen = Shard(pool, RankTokens({0: "rank-zero-0123456789", 1: "rank-one-0123456789"})), []
    source = pull_rows_handler(seen)
    first = shard.handler(PULL_ROWS, source, token="rank-one-0123456789")
    assert shard.handler(PULL_ROWS, source, token="rank-one-0123456789") is first
    assert shard.handler(PULL_ROWS, source, token="rank-zero-0123456789") is not first
    assert shard.handler(PULL_ROWS, source, token="nope") is shard.handler(PULL_ROWS, source, token="nope")
    first.unary_unary(ps_pb2.PullRowsRequest(), FakeContext())
    assert seen == [(ps_pb2.PullRowsRequest(), Caller(RANK, 1))]
    assert (
        shard.handler(PULL_ROWS, pull_rows_handler(seen), token="rank-one-0123456789") is not first
    )  # another handler
