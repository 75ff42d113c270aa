"""A stage of the shard's interceptor (:mod:`ps_server.service.chain`) that gives each data-path
call of ParameterService a span (:mod:`ps_common.tracing`), the child of the worker's span whose
``traceparent`` the call's metadata carries.

The shard adds it only while tracing is on (``ps_server.server``): off, no stage and no cost. It
sits inside the token check, the stream limits and the waiting calls (which pick the call's thread
pool), so the span runs on the thread that serves the call, and the spans the shard opens
there (``push``, ``optimizer_step``, ``round_wait``, ``pull``) are its children. Heartbeats, Admin,
Health and reflection are not traced. A PushPullOnce sent as a call on a data connection has no
metadata: the servicer opens its span from ``PushHeader.traceparent``
(:meth:`~ps_server.service.parameters.ParameterServicer.push_pull_once_chunks`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc

from ps_common import tracing
from ps_server.service.chain import Behavior, carry

TRACED = frozenset(
    "ps.v1.ParameterService/" + m
    for m in ("Join", "Init", "Push", "Pull", "PushPull", "PushPullOnce", "Exchange", "Leave", "PullRows", "PushRows")
)
"""The methods that get a span (a step's calls, and joining and leaving)."""


def traced(method: str, handler: grpc.RpcMethodHandler, behavior: Behavior) -> Behavior:
    """The stage (:data:`ps_server.service.chain.Stage`): a span per call of a :data:`TRACED`
    method, named by the method, kind SERVER, with the caller's trace context from the
    ``traceparent`` metadata (none: a root span); the other methods as they are."""
    name = method.lstrip("/")
    if name not in TRACED:
        return behavior
    if handler.response_streaming:

        def streamed(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            with tracing.server_span(name, context.invocation_metadata()):
                yield from behavior(request, context)

        return carry(behavior, streamed)

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        with tracing.server_span(name, context.invocation_metadata()):
            return behavior(request, context)

    return carry(behavior, unary)
