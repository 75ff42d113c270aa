"""The data plane's waiting calls, kept off the threads that Health, Admin and Join need, and bounded.

grpc's sync server runs a handler in a pool thread for the handler's whole life. The calls of
``ps.v1.ParameterService`` that can last (a Pull or PushPull waiting for its sync round, a PullRows
for the next table version, an InitTables of rank r > 0 waiting for rank 0's tables, a client
stream such as Push, PushPull or Init that has not sent its last message) would otherwise hold the
threads of the one pool, and a client with the worker token could take all of them: Health, Admin
and Join would then wait behind it (``DEADLINE_EXCEEDED``). So:

- Those methods (:data:`WAITING_METHODS`) run in a pool of their own (grpc's
  ``experimental_thread_pool``, as :mod:`ps_server.streams` does for long-lived streams); Join,
  Heartbeat, Leave, PushRows, Admin, Health and reflection keep the server's pool.
- At most ``limit`` of them run at once (``--max-waiting-calls``; by default two per worker plus 8,
  where sync training needs one per worker and shard). One more is refused at once with
  ``RESOURCE_EXHAUSTED``, the trailing ``ps-reason: TOO_MANY_WAITS`` (workers retry it with backoff)
  and a message naming the flag. The pool has a few threads beyond ``limit`` that answer refusals.
- Each call's waits end when the call is cancelled or its deadline passes
  (:func:`ps_server.waits.serving`), and its slot is freed when its handler ends or the call ends,
  whichever comes first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from ps_common.errors import REASON_KEY, Reason

SERVICE = "/ps.v1.ParameterService/"
WAITING_METHODS = frozenset({"Init", "Push", "Pull", "PushPull", "PushPullOnce", "Exchange", "InitTables", "PullRows"})
"""ParameterService methods whose handlers can last: they wait on the shard, or read a client stream."""
REFUSAL_THREADS = 4
"""Threads of the waiting calls' pool beyond the limit: they refuse extra calls at once."""
FLAG = "--max-waiting-calls"


class WaitingCalls(grpc.ServerInterceptor):
    """Run :data:`WAITING_METHODS` in ``pool``, at most ``limit`` at once.

    Put it after the token interceptor, so that a refused token never takes a slot.

    Args:
        limit: waiting calls admitted at once (>= 1).
        pool: where they run: ``limit + REFUSAL_THREADS`` threads, so that an admitted call never
            waits for a thread and a refusal is answered at once.
        shard_index: for messages.
    """

    def __init__(self, limit: int, pool: futures.ThreadPoolExecutor, shard_index: int = 0) -> None:
        self.limit = limit
        self.pool = pool
        self.shard_index = shard_index
        self.open = 0
        """Calls admitted and not yet ended."""
        self.refused = 0
        """Calls refused because ``limit`` were open."""
        self._lock = threading.Lock()

    def _acquire(self) -> bool:
        with self._lock:
            if self.open >= self.limit:
                self.refused += 1
                return False
            self.open += 1
            return True

    def _slot(self, context: grpc.ServicerContext) -> Callable[[], None]:
        """Take a slot or abort the call; returns the slot's release (idempotent), which also runs
        when the call ends (cancelled, past its deadline)."""
        if not self._acquire():
            context.set_trailing_metadata(((REASON_KEY, str(Reason.TOO_MANY_WAITS)),))
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{FLAG} {self.limit} reached: shard {self.shard_index} already holds {self.limit} calls that wait "
                "(pushes and pulls for their rounds, table reads, client streams not finished). Retry with "
                f"backoff, give every call a deadline, or raise {FLAG} (PS_MAX_WAITING_CALLS).",
            )
        once = threading.Lock()

        def release() -> None:
            if once.acquire(blocking=False):
                with self._lock:
                    self.open -= 1

        if not context.add_callback(release):  # the call has already ended
            release()
        return release

    def _unary_response(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        def handle(request: Any, context: grpc.ServicerContext) -> Any:
            release = self._slot(context)
            try:
                return behavior(request, context)
            finally:
                release()

        handle.experimental_thread_pool = self.pool  # type: ignore[attr-defined]
        return handle

    def _stream_response(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        def handle(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            release = self._slot(context)
            try:
                yield from behavior(request, context)
            finally:
                release()

        handle.experimental_thread_pool = self.pool  # type: ignore[attr-defined]
        return handle

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        method = details.method
        if handler is None or not method.startswith(SERVICE) or method[len(SERVICE) :] not in WAITING_METHODS:
            return handler
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(self._stream_response(handler.stream_stream), **kwargs)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(self._unary_response(handler.stream_unary), **kwargs)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(self._stream_response(handler.unary_stream), **kwargs)
        return grpc.unary_unary_rpc_method_handler(self._unary_response(handler.unary_unary), **kwargs)
