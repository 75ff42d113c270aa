"""The outermost stage of the shard's interceptor (:mod:`ps_server.service.chain`): every RPC recorded
in :class:`~ps_server.metrics.ServerMetrics`.

It wraps the behavior of every method (all four streaming kinds) and records the duration and
final status code (``OK`` unless the handler aborted; the code ``context.abort`` set otherwise,
``UNKNOWN`` for an unexpected exception, ``CANCELLED`` when the client went away mid-stream),
and the serialized size of every request and response message (into the shard's
:class:`~ps_server.shard.counters.ShardCounters`, which GetStatus reads too). It counts the refused push
calls the shard did not count itself (any ``ps-reason`` outside
:data:`~ps_server.shard.counters.SHARD_REASONS`: bad input, the token check, limits, deadlines), by status
code, and from ``Pull`` it records the time to the first partition (the wait for its version).
Accepted pushes reach the counters from the servicer (``ShardCounters.pushed``), not through here.

Outermost, it also sees the refusals of the token check (``UNAUTHENTICATED``,
``PERMISSION_DENIED``) and of the stream limits (``RESOURCE_EXHAUSTED``). Its wrappers keep what
grpc's sync server reads off a behavior: a callback-style stream stays non-blocking, and a stream
with a thread pool of its own (:mod:`ps_server.service.streams`) stays in that pool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from ps_common.errors import REASON_KEY
from ps_common.wire import message_size
from ps_server.metrics import ServerMetrics
from ps_server.service.chain import Behavior, carry
from ps_server.shard.counters import SHARD_REASONS

PUSH_METHOD = "ps.v1.ParameterService/Push"
PULL_METHOD = "ps.v1.ParameterService/Pull"
PUSH_PULL = "ps.v1.ParameterService/PushPull"
"""The method the data connections' bytes are counted under (ps_received_bytes_total, ps_sent_bytes_total)."""
PUSH_PULL_ONCE = "ps.v1.ParameterService/PushPullOnce"
"""Also the method of the calls on the data connections (their duration, codes and bytes)."""
PUSH_PULL_METHODS = frozenset({PUSH_PULL, PUSH_PULL_ONCE})
PUSH_METHODS = frozenset({PUSH_METHOD, *PUSH_PULL_METHODS})
WAIT_METHODS = frozenset({PULL_METHOD, *PUSH_PULL_METHODS})

REJECT_REASONS = {grpc.StatusCode.ABORTED: "stale"}
"""Status code -> ``reason`` label of ``ps_rejected_pushes_total`` where it differs from the code's name."""


def _reason(context: grpc.ServicerContext) -> str:
    """The ``ps-reason`` trailing metadata the servicer set on a refusal ("" when none)."""
    metadata = context.trailing_metadata() if hasattr(context, "trailing_metadata") else None
    return next((str(v) for k, v in metadata or () if k == REASON_KEY), "")


WAIT_ENDED = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
"""Codes with which a Pull's wait ends without a partition; that wait is still observed."""


def _size(message: Any) -> int:
    if isinstance(message, bytes | memoryview):  # a hand-built frame (ps_common.frames)
        return memoryview(message).nbytes
    if isinstance(message, list):  # a data connection's answer: bytes and byte views (frames.build_chunks)
        return sum(map(len, message))
    return message_size(message) if hasattr(message, "DESCRIPTOR") else 0


def _final_code(context: grpc.ServicerContext, failed: bool) -> grpc.StatusCode:
    """The code set by ``abort``/``set_code``; else OK, CANCELLED (the client went away mid-call) or
    UNKNOWN (the handler raised)."""
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode):
        return code
    if not failed:
        return grpc.StatusCode.OK
    return grpc.StatusCode.UNKNOWN if context.is_active() else grpc.StatusCode.CANCELLED


class _Call:
    """Bookkeeping of one RPC: bytes as they pass, then one :meth:`finish`."""

    __slots__ = ("recorder", "method", "start", "first_sent", "received", "sent", "reason")

    def __init__(self, recorder: CallMetrics, method: str) -> None:
        self.recorder = recorder
        self.method = method
        self.start = time.perf_counter()
        self.first_sent: float | None = None
        self.received = 0
        self.sent = 0
        self.reason = ""

    def requests(self, iterator: Iterator[Any]) -> Iterator[Any]:
        for msg in iterator:
            self.received += _size(msg)
            yield msg

    def responses(self, iterator: Iterator[Any]) -> Iterator[Any]:
        for msg in iterator:
            if self.first_sent is None:
                self.first_sent = time.perf_counter()
            self.sent += _size(msg)
            yield msg

    def finish(self, code: grpc.StatusCode, reason: str = "") -> None:
        self.reason = reason
        self.recorder.record(self, code, time.perf_counter())


class CallMetrics:
    """Record duration, status code and message bytes of every RPC.

    Args:
        metrics: where to record (bytes and refusals into ``metrics.counters``).
    """

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._durations: dict[tuple[str, grpc.StatusCode], Any] = {}
        """(method, code) -> its ``rpc_duration`` child: ``labels()`` looked up once, not per call
        (at most the service's methods times gRPC's 17 codes)."""

    def record(self, call: _Call, code: grpc.StatusCode, end: float) -> None:
        """Account one finished RPC."""
        m = self.metrics
        duration = self._durations.get((call.method, code))
        if duration is None:
            duration = self._durations[call.method, code] = m.rpc_duration.labels(call.method, code.name)
        duration.observe(end - call.start)
        m.counters.transferred(call.method, call.received, call.sent)
        refused = code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED)
        if call.method in PUSH_METHODS and refused and call.reason not in SHARD_REASONS:
            m.counters.refuse(REJECT_REASONS.get(code, code.name.lower()))
        if call.method in WAIT_METHODS:
            if call.first_sent is not None:
                m.barrier_wait.observe(call.first_sent - call.start)
            elif code in WAIT_ENDED:
                m.barrier_wait.observe(end - call.start)

    def unary(self, behavior: Callable[[Any, Any], Any], method: str) -> Callable[[Any, Any], Any]:
        """``behavior`` (a unary handler) recorded as ``method`` is: for calls that reach a servicer
        method without gRPC (a data connection's calls, :mod:`ps_server.dataplane.connections`)."""
        return self._unary_response(behavior, method, False)

    # -------------------------------------------------------------- the four handler kinds
    def _unary_response(self, behavior: Callable[..., Any], method: str, streaming: bool) -> Callable[..., Any]:
        def handle(request: Any, context: grpc.ServicerContext) -> Any:
            call = _Call(self, method)
            if streaming:
                request = call.requests(request)
            else:
                call.received = _size(request)
            try:
                response = behavior(request, context)
            except BaseException:
                call.finish(_final_code(context, failed=True), _reason(context))
                raise
            call.first_sent = time.perf_counter()
            call.sent = _size(response)
            call.finish(_final_code(context, failed=False))
            return response

        return handle

    def _stream_response(self, behavior: Callable[..., Any], method: str, streaming: bool) -> Callable[..., Any]:
        def handle(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            call = _Call(self, method)
            if streaming:
                request = call.requests(request)
            else:
                call.received = _size(request)
            try:
                yield from call.responses(behavior(request, context))
            except GeneratorExit:  # the client cancelled; gRPC stopped iterating
                call.finish(grpc.StatusCode.CANCELLED)
                raise
            except BaseException:
                call.finish(_final_code(context, failed=True), _reason(context))
                raise
            code = _final_code(context, failed=False)
            if code is grpc.StatusCode.OK and not context.is_active():  # it saw the client go away (WatchStatus)
                code = grpc.StatusCode.CANCELLED
            call.finish(code)

        return handle

    def _non_blocking(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        """A callback-style stream (``experimental_non_blocking``, e.g. Health/Watch): it holds no
        thread, and ends when the servicer sends None."""

        def handle(request: Any, context: grpc.ServicerContext, send: Callable[[Any], None]) -> Any:
            call = _Call(self, method)
            call.received = _size(request)
            ended = threading.Lock()

            def forward(response: Any) -> None:
                if response is None:
                    if ended.acquire(blocking=False):
                        code = _final_code(context, failed=False)
                        if code is grpc.StatusCode.OK and not context.is_active():
                            code = grpc.StatusCode.CANCELLED
                        call.finish(code)
                else:
                    if call.first_sent is None:
                        call.first_sent = time.perf_counter()
                    call.sent += _size(response)
                send(response)

            try:
                return behavior(request, context, forward)
            except BaseException:
                if ended.acquire(blocking=False):
                    call.finish(_final_code(context, failed=True))
                raise

        handle.experimental_non_blocking = True  # type: ignore[attr-defined]
        return handle

    def wrap(self, method: str, handler: grpc.RpcMethodHandler, behavior: Behavior) -> Behavior:
        """The stage (:data:`ps_server.service.chain.Stage`): ``behavior`` of ``method`` recorded."""
        name = method.lstrip("/")
        streaming = bool(handler.request_streaming)
        if not handler.response_streaming:
            wrapped = self._unary_response(behavior, name, streaming)
        elif not streaming and getattr(behavior, "experimental_non_blocking", False):
            wrapped = self._non_blocking(behavior, name)
        else:
            wrapped = self._stream_response(behavior, name, streaming)
        return carry(behavior, wrapped)
