"""Requests that do not decode get INVALID_ARGUMENT with a short message, on every service.

gRPC answers a request its deserializer cannot parse with INTERNAL and logs the traceback at ERROR.
The shard's interceptor (:mod:`ps_server.service.chain`) gives every handler a deserializer that
never raises (:func:`lenient`): undecodable bytes become an :class:`Undecodable` marker, and
:class:`Decoding`, its innermost stage, refuses the call with INVALID_ARGUMENT (and the
``ps-reason`` INVALID) before the servicer sees it. Methods that read their own bytes
(``ps_common.frames``) already refuse malformed ones with INVALID_ARGUMENT and are left as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from ps_common.errors import REASON_KEY, InvalidRequestError
from ps_server.service.chain import Behavior

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


class Decoding:
    """Refuse undecodable requests with INVALID_ARGUMENT on every method that has a deserializer.

    The innermost stage (:mod:`ps_server.service.chain`): the chain gives the handler the
    :func:`lenient` deserializer, whose :class:`Undecodable` only this stage may see.

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

    def wrap(self, method: str, handler: grpc.RpcMethodHandler, behavior: Behavior) -> Behavior:
        """The stage (:data:`ps_server.service.chain.Stage`): an undecodable request refused."""
        if handler.request_deserializer is None:
            return behavior
        name = method.lstrip("/")
        if handler.request_streaming:

            def streaming(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                return behavior(self._checked(name, requests, context), context)

            return streaming

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                self._refuse(name, request, context)
            return behavior(request, context)

        return unary
