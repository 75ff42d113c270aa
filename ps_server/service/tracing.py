"""A gRPC server interceptor that gives each data-path call of ParameterService a span
(:mod:`ps_common.tracing`), the child of the worker's span whose ``traceparent`` the call's
metadata carries.

The shard installs it only while tracing is on (``ps_server.server``): off, no interceptor and no
cost. It sits inside the token, stream-limit and waiting-call interceptors (which pick the call's
thread pool), so the span runs on the thread that serves the call, and the spans the shard opens
there (``push``, ``optimizer_step``, ``round_wait``, ``pull``) are its children. Heartbeats, Admin,
Health and reflection are not traced. A PushPullOnce sent as a call on a data connection has no
metadata: the servicer opens its span from ``PushHeader.traceparent``
(:meth:`~ps_server.service.parameters.ParameterServicer.push_pull_once_chunks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from ps_common import tracing
from ps_server.service.handlers import behavior_of, rebuilt

TRACED = frozenset(
    "ps.v1.ParameterService/" + m
    for m in ("Join", "Init", "Push", "Pull", "PushPull", "PushPullOnce", "Exchange", "Leave", "PullRows", "PushRows")
)
"""The methods that get a span (a step's calls, and joining and leaving)."""


class TracingInterceptor(grpc.ServerInterceptor):
    """A span per call of a :data:`TRACED` method, named by the method, kind SERVER, with the
    caller's trace context from the ``traceparent`` metadata (none: a root span)."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        method = details.method.lstrip("/")
        if handler is None or method not in TRACED:
            return handler
        behavior = behavior_of(handler)
        if handler.response_streaming:

            def streamed(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                with tracing.server_span(method, context.invocation_metadata()):
                    yield from behavior(request, context)

            wrapped: Callable[..., Any] = streamed
        else:

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                with tracing.server_span(method, context.invocation_metadata()):
                    return behavior(request, context)

            wrapped = unary
        pool = getattr(behavior, "experimental_thread_pool", None)
        if pool is not None:  # keep the pool grpc's sync server picks for the behavior
            wrapped.experimental_thread_pool = pool  # type: ignore[attr-defined]
        return rebuilt(handler, wrapped)
