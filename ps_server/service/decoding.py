"""Requests that do not decode get INVALID_ARGUMENT with a short message, on every service.

gRPC answers a request its deserializer cannot parse with INTERNAL and logs the traceback at ERROR.
:class:`DecodingInterceptor` gives every handler a deserializer that never raises: undecodable
bytes become an :class:`Undecodable` marker, and the call is refused with INVALID_ARGUMENT (and the
``ps-reason`` INVALID) before the servicer sees it. Methods that read their own bytes
(``ps_common.frames``) already refuse malformed ones with INVALID_ARGUMENT and are left as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from ps_common.errors import REASON_KEY, InvalidRequestError
from ps_server.service.handlers import behavior_of, rebuilt

log = logging.getLogger(__name__)


class Undecodable:
    """What a lenient deserializer returns for bytes that do not parse: their size only."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


def lenient(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``deserializer``, returning :class:`Undecodable` instead of raising."""

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception:
            return Undecodable(len(raw))

    return deserialize


class DecodingInterceptor(grpc.ServerInterceptor):
    """Refuse undecodable requests with INVALID_ARGUMENT on every method that has a deserializer.

    Place it last (innermost): interceptors outside it keep its deserializer.

    Args:
        on_refused: called once per refused call (the shard's refusal counter).
    """

    def __init__(self, on_refused: Callable[[], None] | None = None) -> None:
        self.on_refused = on_refused

    def _refuse(self, method: str, bad: Undecodable, context: grpc.ServicerContext) -> None:
        message = (
            f"The request to {method} ({bad.size} bytes) does not decode as its protobuf message; "
            "send a valid message of the method's request type."
        )
        log.warning("%s refused (INVALID_ARGUMENT): %s", method, message)
        if self.on_refused is not None:
            self.on_refused()
        context.set_trailing_metadata(((REASON_KEY, str(InvalidRequestError.reason)),))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    def _checked(self, method: str, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        for request in requests:
            if isinstance(request, Undecodable):
                self._refuse(method, request, context)
            yield request

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = details.method.lstrip("/")
        inner = behavior_of(handler)
        deserializer = lenient(handler.request_deserializer)
        if handler.request_streaming:

            def streaming(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                return inner(self._checked(method, requests, context), context)

            return rebuilt(handler, streaming, request_deserializer=deserializer)

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                self._refuse(method, request, context)
            return inner(request, context)

        return rebuilt(handler, unary, request_deserializer=deserializer)
