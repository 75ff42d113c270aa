"""The shard's one gRPC server interceptor: every per-call concern, composed once per method.

A ``grpc.RpcMethodHandler`` carries one behavior of four kinds (unary or streaming request and
response) and its (de)serializers. Each concern of the shard is a stage, a function of the method
(``"/ps.v1.ParameterService/Push"``), its handler (whose kind it reads) and the behavior inside it,
that returns the behavior wrapped (or as it is). :class:`Chain` applies them in one fixed order and
builds one handler, once per method (and per outcome of the token check), then serves it from a
cache. From the outside in:

1. metrics (:mod:`ps_server.service.call_metrics`): sees every call, the refusals below included;
2. the token check (:mod:`ps_server.service.auth`): the only step taken per call, from the call's
   metadata: the call goes on, goes on as a rank's (its context gets a ``caller``), or is refused
   before anything that does work (a refusal takes no stream slot nor waiting call);
3. the stream limits (:mod:`ps_server.service.streams`) and the waiting calls
   (:mod:`ps_server.service.waiting_calls`): caps, and the thread pool a call runs in;
4. tracing (:mod:`ps_server.service.tracing`), only while tracing is on: inside the stages that pick
   the pool, so its span runs on the thread that serves the call;
5. decoding (:mod:`ps_server.service.decoding`), innermost: it gives the handler a deserializer that
   never raises, and refuses what did not decode before the servicer sees it.

A stage that wraps a behavior keeps what grpc's sync server reads off it: the thread pool it picks
(``experimental_thread_pool``) and a callback-style stream (``experimental_non_blocking``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc

Behavior = Callable[..., Any]
Stage = Callable[[str, grpc.RpcMethodHandler, Behavior], Behavior]
"""One concern: the behavior of the method (its handler gives the kind) wrapped, or as it is."""


class Outcome(Protocol):
    """What the per-call check makes of a call that does not simply go on (one of few: the handler
    built for it is cached): a stage of its own."""

    reads: bool
    """False: the handler answers before it reads the request (a refusal), and gets no serializers."""

    def wrap(self, behavior: Behavior) -> Behavior: ...


Deserializer = Callable[[bytes], Any]

HANDLER_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}
"""grpc's handler factory of each kind, by (request streaming, response streaming)."""


def behavior_of(handler: grpc.RpcMethodHandler) -> Behavior:
    """The one behavior ``handler`` carries (``unary_unary``, ``stream_unary``, ...)."""
    if handler.request_streaming:
        return handler.stream_stream if handler.response_streaming else handler.stream_unary
    return handler.unary_stream if handler.response_streaming else handler.unary_unary


def carry(behavior: Behavior, wrapper: Behavior) -> Behavior:
    """``wrapper`` with the thread pool that grpc's sync server picks for ``behavior``
    (``experimental_thread_pool``, see :mod:`ps_server.service.streams`): wrapping must not move a
    call into another pool."""
    pool = getattr(behavior, "experimental_thread_pool", None)
    if pool is not None:
        wrapper.experimental_thread_pool = pool  # type: ignore[attr-defined]
    return wrapper


class Chain(grpc.ServerInterceptor):
    """Wrap each handler once: ``record`` outermost, then the outcome of ``admit``, then ``stages``.

    Args:
        record: the outermost stage (the metrics): it sees every call, refusals included.
        stages: the stages inside the per-call check, outermost first (stream limits, waiting calls,
            tracing, decoding).
        admit: the per-call check, of the method and the call's invocation metadata: None (the call
            goes on) or an :class:`Outcome` (a rank's call, a refusal). None: every call goes on.
        deserializer: what each handler's request deserializer becomes (decoding's lenient one, which
            its stage relies on).
    """

    def __init__(
        self,
        record: Stage,
        stages: Sequence[Stage] = (),
        admit: Callable[[str, Any], Outcome | None] | None = None,
        deserializer: Callable[[Deserializer], Deserializer] | None = None,
    ) -> None:
        self.record = record
        self.stages = tuple(stages)
        self.admit = admit
        self.deserializer = deserializer
        self._built: dict[tuple[str, Outcome | None], tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED; no label for arbitrary names
            return None
        method = details.method
        outcome = self.admit(method, details.invocation_metadata) if self.admit is not None else None
        built = self._built.get((method, outcome))
        if built is None or built[0] is not handler:  # built anew only if the method's handler changed
            built = (handler, self._build(method, handler, outcome))
            self._built[(method, outcome)] = built
        return built[1]

    def _build(self, method: str, handler: grpc.RpcMethodHandler, outcome: Outcome | None) -> grpc.RpcMethodHandler:
        behavior = behavior_of(handler)
        for stage in reversed(self.stages):  # the innermost first
            behavior = stage(method, handler, behavior)
        if outcome is not None:
            behavior = outcome.wrap(behavior)
        behavior = self.record(method, handler, behavior)
        make = HANDLER_MAKERS[(bool(handler.request_streaming), bool(handler.response_streaming))]
        if outcome is not None and not outcome.reads:
            return make(behavior)
        deserializer = handler.request_deserializer
        if deserializer is not None and self.deserializer is not None:
            deserializer = self.deserializer(deserializer)
        return make(behavior, request_deserializer=deserializer, response_serializer=handler.response_serializer)
