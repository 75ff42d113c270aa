"""The waiting calls' admission (ps_server.service.waiting_calls) with fake calls: which methods it takes,
its cap, its refusal, and the slot freed when the handler or the call ends. No sockets."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from ps_common.errors import REASON_KEY
from ps_server.service.chain import Chain
from ps_server.service.waiting_calls import WAITING_METHODS, WaitingCalls


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []
        self.ended = False
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.metadata: tuple[tuple[str, str], ...] = ()

    def add_callback(self, callback: Callable[[], None]) -> bool:
        if self.ended:
            return False
        self.callbacks.append(callback)
        return True

    def end(self) -> None:
        self.ended = True
        for callback in self.callbacks:
            callback()

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.metadata = tuple(metadata)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise Aborted(details)


class Details:
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


@pytest.fixture
def pool() -> Iterator[futures.ThreadPoolExecutor]:
    executor = futures.ThreadPoolExecutor(1)
    yield executor
    executor.shutdown(wait=False)


def intercept(waiting: WaitingCalls, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` in a chain of the waiting calls' stage alone."""
    chain = Chain(lambda method, handler, behavior: behavior, [waiting.wrap])
    result = chain.intercept_service(lambda details: handler, Details(method))
    assert result is not None
    return result


def test_calls_that_may_wait_run_in_their_pool_and_the_others_are_left_alone(pool) -> None:
    waiting = WaitingCalls(2, pool)
    unary = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    behavior = unary.unary_unary
    for name in ("Join", "Heartbeat", "Leave", "PushRows"):
        assert waiting.wrap(f"/ps.v1.ParameterService/{name}", unary, behavior) is behavior
    assert waiting.wrap("/ps.v1.Admin/GetStatus", unary, behavior) is behavior
    assert waiting.wrap("/grpc.health.v1.Health/Check", unary, behavior) is behavior
    for name in WAITING_METHODS:
        wrapped = intercept(waiting, f"/ps.v1.ParameterService/{name}", unary)
        assert wrapped.unary_unary is not behavior and wrapped.unary_unary.experimental_thread_pool is pool


def test_one_call_more_than_the_limit_is_refused_at_once_and_a_slot_comes_back(pool) -> None:
    waiting = WaitingCalls(2, pool, shard_index=3)
    inside: list[int] = []
    handler = intercept(
        waiting,
        "/ps.v1.ParameterService/PullRows",
        grpc.unary_unary_rpc_method_handler(lambda request, context: inside.append(waiting.open) or request),
    )
    held = [FakeContext(), FakeContext()]
    # two calls hold their slots (a wait in progress: their handlers run in other threads)
    releases = [waiting._slot(context) for context in held]
    assert waiting.open == 2
    refused = FakeContext()
    with pytest.raises(Aborted):
        handler.unary_unary("req", refused)
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (REASON_KEY, "TOO_MANY_WAITS") in refused.metadata
    assert "--max-waiting-calls 2" in refused.details and "shard 3" in refused.details
    assert waiting.refused == 1 and waiting.open == 2
    held[0].end()  # cancelled: its slot is freed by the call's end, once
    releases[0]()
    assert waiting.open == 1
    assert handler.unary_unary("req", FakeContext()) == "req"
    assert inside == [2] and waiting.open == 1  # the handler's slot freed when it returned
    releases[1]()
    assert waiting.open == 0


def test_a_streaming_response_frees_its_slot_when_it_ends_or_its_call_ends(pool) -> None:
    waiting = WaitingCalls(1, pool)

    def pull(request: Any, context: Any) -> Iterator[str]:
        yield "a"
        yield "b"

    handler = intercept(waiting, "/ps.v1.ParameterService/Pull", grpc.unary_stream_rpc_method_handler(pull))
    assert list(handler.unary_stream("req", FakeContext())) == ["a", "b"]
    assert waiting.open == 0
    context = FakeContext()
    stream = handler.unary_stream("req", context)
    assert next(stream) == "a" and waiting.open == 1
    context.end()  # the client went away mid-stream; grpc stops reading the generator
    assert waiting.open == 0
    stream.close()
    assert waiting.open == 0
