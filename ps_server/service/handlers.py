"""grpc method handlers rebuilt around a new behavior: what every interceptor of the shard does.

A ``grpc.RpcMethodHandler`` carries one behavior of four kinds (unary or streaming request and
response) and its (de)serializers; an interceptor that wraps the behavior must build a handler of the
same kind with the same serializers. These two functions are that, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Behavior = Callable[..., Any]

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


def rebuilt(
    handler: grpc.RpcMethodHandler,
    behavior: Behavior,
    request_deserializer: Callable[[bytes], Any] | None = None,
    serializers: bool = True,
) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind running ``behavior``.

    Args:
        handler: the handler whose kind (and serializers) to keep.
        behavior: the new behavior, of that kind's signature.
        request_deserializer: replaces ``handler``'s request deserializer when given.
        serializers: False builds the handler without serializers (one that answers before it reads,
            e.g. a refusal).
    """
    make = HANDLER_MAKERS[(bool(handler.request_streaming), bool(handler.response_streaming))]
    if not serializers:
        return make(behavior)
    return make(
        behavior,
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
