"""Bearer-token authorization of a shard's services (DESIGN section 8).

``ps.v1.ParameterService`` takes the worker token (or the admin token); ``ps.v1.Admin`` takes
only the admin token. Health and reflection stay open. Tokens compare in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import grpc

PARAMETER_PREFIX = "/ps.v1.ParameterService/"
ADMIN_PREFIX = "/ps.v1.Admin/"


def _bearer(metadata: tuple[tuple[str, Any], ...] | None) -> str | None:
    """The token of the first ``authorization: Bearer <token>``; the scheme's name is
    case-insensitive and may be followed by several spaces (RFC 6750 section 2.1, RFC 9110 11.1)."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, space, token = value.partition(" ")
            if space and scheme.lower() == "bearer":
                return token.lstrip(" ")
    return None


def _matches(given: str, expected: str) -> bool:
    return bool(expected) and hmac.compare_digest(given.encode(), expected.encode())


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that aborts with ``code``."""

    def abort(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuse ParameterService and Admin calls without the right bearer token.

    Args:
        token: worker token; empty disables the check on ParameterService.
        admin_token: operator token; empty disables the check on Admin.
        on_refused: called with the status code of every refusal (for counting).
    """

    def __init__(self, token: str, admin_token: str, on_refused: Callable[[grpc.StatusCode], None] | None = None):
        self.token = token
        self.admin_token = admin_token
        self.on_refused = on_refused

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        method = details.method
        if handler is None:
            return handler
        if method.startswith(PARAMETER_PREFIX):
            accepted = [t for t in (self.token, self.admin_token) if t]
            if not self.token:
                return handler
            what = "the worker token (PS_TOKEN)"
        elif method.startswith(ADMIN_PREFIX):
            accepted = [self.admin_token] if self.admin_token else []
            if not self.admin_token:
                return handler
            what = "the admin token (PS_ADMIN_TOKEN)"
        else:
            return handler
        given = _bearer(details.invocation_metadata)
        if given is not None and any(_matches(given, t) for t in accepted):
            return handler
        if given is not None and method.startswith(ADMIN_PREFIX) and _matches(given, self.token):
            code, msg = (
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} needs {what}; the worker token may not call Admin.",
            )
        elif given is None:
            code, msg = grpc.StatusCode.UNAUTHENTICATED, f"{method} needs 'authorization: Bearer <token>' with {what}."
        else:
            code, msg = grpc.StatusCode.UNAUTHENTICATED, f"The bearer token sent to {method} is wrong; send {what}."
        if self.on_refused:
            self.on_refused(code)
        return _refusal(handler, code, msg)
