"""Long-lived streams kept off the data plane's threads, and bounded in number.

grpc's sync server runs a handler in a pool thread for the handler's whole life, so a stream that
stays open (``Admin/WatchStatus`` for ``ps-admin top``, a reflection stream) holds a thread for as
long as its client keeps it. In the data plane's pool, a few such streams (or unauthenticated
Health/Watch ones) would take every thread that pushes and pulls need, and training would stop.
So, on the same port (grpcurl and Kubernetes probes need it):

- ``grpc.health.v1.Health/Watch`` stays non-blocking (grpc_health answers through a callback, see
  ``experimental_non_blocking``): it holds no thread at all, only a slot of its group.
- Every other long-lived stream runs in a pool of its own (grpc's ``experimental_thread_pool``),
  sized to the limits below, never in the data plane's pool.
- Each group of streams is capped; one more is refused at once with ``RESOURCE_EXHAUSTED``, a
  message naming the flag, and the trailing ``ps-reason: TOO_MANY_STREAMS``.

Groups: ``watch``, the streaming methods of ``ps.v1.Admin`` (``--max-watch-streams``); ``public``,
the streaming methods of services that need no token, Health and reflection
(``--max-public-streams``). The streams of ``ps.v1.ParameterService`` are the data plane: never
limited here (those that may wait run in a capped pool of their own: :mod:`ps_server.service.waiting_calls`).

Why this design: a second server would need a second port (grpcurl and Kubernetes probes dial the
shard's one port), and a ``grpc.aio`` server would mean rewriting the servicers and the interceptor's stages
around blocking waits. The two hooks used here are grpcio's own (``grpc_health`` relies on both);
were a later grpcio to drop them, the caps would still hold and ``tests/adversarial/test_threads.py``
would show the streams back in the data plane's pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from ps_common.errors import REASON_KEY, Reason
from ps_server.service.chain import Behavior

DATA_SERVICE = "/ps.v1.ParameterService/"
WATCH_SERVICE = "/ps.v1.Admin/"
WATCH = "watch"
PUBLIC = "public"
REASON = Reason.TOO_MANY_STREAMS
"""``ps-reason`` of a refused stream: not worth retrying until another stream closes."""


@dataclass
class StreamLimit:
    """A cap on the streams of one group open at once.

    Args:
        limit: streams allowed at once (>= 1).
        what: the streams, for the refusal message ("Admin/WatchStatus streams (ps-admin top)").
        flag: the flag that sets ``limit``.
    """

    limit: int
    what: str
    flag: str
    open: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def acquire(self) -> bool:
        """Take a slot; False when all ``limit`` are taken."""
        with self._lock:
            if self.open >= self.limit:
                return False
            self.open += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.open -= 1

    def refusal(self) -> str:
        return (
            f"{self.flag} {self.limit} reached: this shard already serves {self.limit} {self.what}; "
            "close one or raise the limit."
        )


def stream_group(method: str, handler: grpc.RpcMethodHandler) -> str | None:
    """The group of a long-lived stream (``watch`` or ``public``), or None for unary methods and the
    data plane."""
    if not (handler.request_streaming or handler.response_streaming) or method.startswith(DATA_SERVICE):
        return None
    return WATCH if method.startswith(WATCH_SERVICE) else PUBLIC


def _refuse(limit: StreamLimit, context: grpc.ServicerContext) -> None:
    context.set_trailing_metadata(((REASON_KEY, str(REASON)),))
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, limit.refusal())


class StreamLimits:
    """Cap the long-lived streams per group and run the blocking ones in ``pool``.

    A stage of the shard's interceptor (:mod:`ps_server.service.chain`), inside the token check, so
    that a refused token never takes a slot.

    Args:
        limits: group name (:data:`WATCH`, :data:`PUBLIC`) -> its cap.
        pool: where blocking long-lived streams run; at least the sum of the limits plus a few threads
            for refusals, so that an admitted stream never waits for a thread.
    """

    def __init__(self, limits: Mapping[str, StreamLimit], pool: futures.ThreadPoolExecutor) -> None:
        self.limits = dict(limits)
        self.pool = pool

    def _non_blocking(self, behavior: Callable[..., Any], limit: StreamLimit) -> Callable[..., Any]:
        """A callback-style stream (Health/Watch): its slot is freed when the call ends."""

        def handle(request: Any, context: grpc.ServicerContext, send: Callable[[Any], None]) -> Any:
            if not limit.acquire():
                _refuse(limit, context)
            once = threading.Lock()

            def release() -> None:
                if once.acquire(blocking=False):
                    limit.release()

            if not context.add_callback(release):  # the call has already ended
                release()
            try:
                return behavior(request, context, send)
            except BaseException:
                release()
                raise

        handle.experimental_non_blocking = True  # type: ignore[attr-defined]
        handle.experimental_thread_pool = getattr(behavior, "experimental_thread_pool", None)  # type: ignore[attr-defined]
        return handle

    def _blocking(self, behavior: Callable[..., Any], limit: StreamLimit) -> Callable[..., Any]:
        """A generator-style stream: its slot is freed when its handler (and its thread) is done."""

        def handle(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if not limit.acquire():
                _refuse(limit, context)
            try:
                yield from behavior(request, context)
            finally:
                limit.release()

        handle.experimental_thread_pool = self.pool  # type: ignore[attr-defined]
        return handle

    def wrap(self, method: str, handler: grpc.RpcMethodHandler, behavior: Behavior) -> Behavior:
        """The stage (:data:`ps_server.service.chain.Stage`): a long-lived stream capped, in its pool."""
        group = stream_group(method, handler)
        limit = self.limits.get(group) if group else None
        if limit is None:
            return behavior
        if not handler.response_streaming:
            return behavior  # a client stream outside the data plane: none exists; it ends with its requests
        if getattr(behavior, "experimental_non_blocking", False):
            return self._non_blocking(behavior, limit)
        return self._blocking(behavior, limit)
