"""Bearer-token authorization of a shard's services (docs/architecture.md#8-security).

``ps.v1.ParameterService`` takes the worker token (or the admin token), and with per-rank
credentials (:mod:`ps_server.service.rank_tokens`) a rank's own token, which makes the call that rank's:
its handler then sees a context whose ``caller`` says who called (:class:`~ps_server.service.rank_tokens.Caller`).
``ps.v1.Admin`` takes only the admin token. Health and reflection stay open. Tokens compare in
constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from ps_server.service.chain import Behavior, carry
from ps_server.service.rank_tokens import ADMIN, RANK, SHARED, Caller, RankTokens

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


@dataclass(frozen=True)
class Refusal:
    """A refused call (an :class:`~ps_server.service.chain.Outcome`): its handler aborts with
    ``code`` and ``message`` before it reads the request."""

    code: grpc.StatusCode
    message: str
    reads = False

    def abort(self, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(self.code, self.message)

    def wrap(self, behavior: Behavior) -> Behavior:
        return self.abort


class CallerContext:
    """A call's grpc context with its :class:`Caller` as ``caller``; everything else is the context's."""

    def __init__(self, context: grpc.ServicerContext, caller: Caller) -> None:
        self._context = context
        self.caller = caller

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


@dataclass(frozen=True)
class Identified:
    """A rank's call (an :class:`~ps_server.service.chain.Outcome`): its behavior gets a
    :class:`CallerContext` of ``caller``."""

    caller: Caller
    reads = True

    def wrap(self, behavior: Behavior) -> Behavior:
        caller = self.caller

        def handle(request: Any, context: grpc.ServicerContext) -> Any:
            return behavior(request, CallerContext(context, caller))

        return carry(behavior, handle)


class TokenCheck:
    """Refuse ParameterService and Admin calls without the right bearer token.

    The per-call check of the shard's interceptor (:mod:`ps_server.service.chain`): outside the stages
    that need to know the caller (:mod:`ps_server.service.waiting_calls`) or that do work.

    Args:
        token: worker token; empty (and no ``rank_tokens``) disables the check on ParameterService.
        admin_token: operator token; empty disables the check on Admin.
        on_refused: called with the status code of every refusal (for counting).
        rank_tokens: per-rank tokens (``--rank-tokens``): a ParameterService call with one is that
            rank's; with them every ParameterService handler gets a ``caller`` on its context.
    """

    def __init__(
        self,
        token: str,
        admin_token: str,
        on_refused: Callable[[grpc.StatusCode], None] | None = None,
        rank_tokens: RankTokens | None = None,
    ):
        self.token = token
        self.admin_token = admin_token
        self.on_refused = on_refused
        self.rank_tokens = rank_tokens

    def _caller(self, given: str | None) -> Caller | None:
        """The caller a ParameterService call's token makes it, None for a wrong or missing token."""
        if given is None:
            return None
        rank = self.rank_tokens.rank_of(given) if self.rank_tokens is not None else None
        if _matches(given, self.admin_token):
            return Caller(ADMIN)
        if rank is not None:
            return Caller(RANK, rank)
        if _matches(given, self.token):
            return Caller(SHARED)
        return None

    def admit(self, method: str, metadata: tuple[tuple[str, Any], ...] | None) -> Identified | Refusal | None:
        """The outcome of a call to ``method`` (``"/ps.v1.Admin/GetStatus"``) with ``metadata``:
        None (it goes on), :class:`Identified` (a rank's own token) or :class:`Refusal`."""
        if method.startswith(PARAMETER_PREFIX):
            if self.rank_tokens is not None:
                caller = self._caller(_bearer(metadata))
                if caller is not None:
                    return Identified(caller)
                accepted = []
                what = "the rank's own token (--rank-tokens) as PS_TOKEN"
            elif not self.token:
                return None
            else:
                accepted = [t for t in (self.token, self.admin_token) if t]
                what = "the worker token (PS_TOKEN)"
        elif method.startswith(ADMIN_PREFIX):
            if not self.admin_token:
                return None
            accepted = [self.admin_token]
            what = "the admin token (PS_ADMIN_TOKEN)"
        else:
            return None
        given = _bearer(metadata)
        if given is not None and any(_matches(given, t) for t in accepted):
            return None
        ranks = self.rank_tokens
        a_rank = given is not None and ranks is not None and ranks.rank_of(given) is not None
        worker = given is not None and (_matches(given, self.token) or a_rank)
        if worker and method.startswith(ADMIN_PREFIX):
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
        return Refusal(code, msg)
