"""Calls on a shard's data connections (:data:`ps_common.dataconn.CALL`): a unary method run
without gRPC, by the connection's thread.

:class:`CallContext` stands for ``grpc.ServicerContext`` where the servicer method and the metrics
interceptor read it (the deadline, whether the worker is still there, the status a refusal sets),
and :func:`run_call` runs one call to the status code and body the connection answers with: the
response (OK), or the refusal's code, ``ps-reason`` and details, as the gRPC call would end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import grpc

from ps_common import dataconn
from ps_common.errors import REASON_KEY

log = logging.getLogger(__name__)


class CallAborted(Exception):
    """Raised by :meth:`CallContext.abort`, as gRPC's own ``abort`` raises, to end the handler."""


class CallContext:
    """What a servicer method and the metrics interceptor read of a ``grpc.ServicerContext``, for
    a call on a data connection: the deadline, whether the worker is still connected, and the
    status a refusal sets (``abort``, ``set_trailing_metadata``).

    Args:
        timeout: seconds the call may take (None: no deadline).
        active: whether the connection is still open.
        peer_rank: the rank the connection's hello named: the call must be stamped with it.
    """

    def __init__(self, timeout: float | None, active: Callable[[], bool], peer_rank: int | None = None) -> None:
        self.peer_rank = peer_rank
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._active = active
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._metadata: tuple[tuple[str, str], ...] = ()

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        return self._active() and (self._deadline is None or time.monotonic() < self._deadline)

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        """End the call with ``code`` and ``details`` (raises :class:`CallAborted`)."""
        self._code, self._details = code, details
        raise CallAborted(details)

    def reason(self) -> str:
        """The ``ps-reason`` the handler set ("" when none)."""
        return next((str(v) for k, v in self._metadata if k == REASON_KEY), "")


CallHandler = Callable[[memoryview, CallContext], dataconn.Body]
"""A unary method on a data connection: the request's bytes (a fresh buffer per call, which the
handler may keep views of) and the context in, the response's bytes out (one buffer, or the
buffers of the message in order, sent without joining them; refusals through ``context.abort``)."""


def run_call(handler: CallHandler, request: memoryview, context: CallContext, what: str) -> tuple[int, dataconn.Body]:
    """Run ``handler`` on ``request``: (status code value, body) of the answer: (0, the response),
    or the code, reason and details a refusal set (``context.abort``), or UNKNOWN for an
    unexpected exception (logged, as gRPC answers one). Never raises."""
    try:
        return 0, handler(request, context)
    except CallAborted:
        code = context.code() or grpc.StatusCode.UNKNOWN
        return code.value[0], dataconn.refusal(context.reason(), context.details())
    except Exception as exc:  # a defect
        log.exception("%s on its data connection failed", what)
        return grpc.StatusCode.UNKNOWN.value[0], dataconn.refusal("", f"Exception calling application: {exc}")
