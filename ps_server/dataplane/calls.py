"""Calls on a shard's data connections (:data:`ps_common.dataconn.CALL`): a unary method run
without gRPC, by the connection's thread.

:class:`CallContext` stands for ``grpc.ServicerContext`` where the servicer method and the metrics
interceptor read it (the deadline, whether the worker is still there, the status a refusal sets),
and :func:`run_call` runs one call to the status code and body the connection answers with: the
response (OK), or the refusal's code, ``ps-reason`` and details, as the gRPC call would end.
:class:`CallServer` reads a call's request from its connection, runs it and sends the answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from ps_common import dataconn
from ps_common.errors import REASON_KEY, InvalidRequestError
from ps_server.dataplane.connection import SEND_SECONDS, Connection

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


class CallServer:
    """Runs the calls that come on a shard's data connections, one at a time per connection, on
    the connection's thread, and counts them.

    Args:
        handler: the servicer's PushPullOnce, wrapped by the metrics interceptor (which counts its
            bytes); None: a call closes its connection.
        max_call_bytes: longest request accepted (the gRPC server's message limit).
    """

    def __init__(self, handler: CallHandler | None, max_call_bytes: int) -> None:
        self._handler = handler
        self.max_call_bytes = max_call_bytes
        self._lock = threading.Lock()  # connection threads answer calls concurrently
        self.calls = 0
        """Calls answered (refusals included)."""

    def serve(self, conn: Connection, sequence: int, timeout_ms: int, nbytes: int) -> None:
        """Read call ``sequence``'s request (``nbytes``) from ``conn``, run the handler here with a
        deadline of ``timeout_ms`` milliseconds (0: none), send its answer.

        Raises:
            InvalidRequestError: no calls are served here, or the request is over the limit (its
                refusal is sent first); the connection closes.
            OSError, DataConnectionError: the connection broke.
        """
        if self._handler is None:
            raise InvalidRequestError(f"call {sequence}: this shard takes no calls on its data connections")
        if nbytes > self.max_call_bytes:
            details = (
                f"A call of {nbytes} bytes is over this shard's limit of {self.max_call_bytes} bytes "
                "(--max-message-bytes)."
            )
            exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            self._answer(conn, sequence, exhausted, dataconn.refusal("", details), 5.0)
            raise InvalidRequestError(f"call {sequence}: {details}")
        request = dataconn.buffer(nbytes)
        dataconn.recv_exact(conn.sock, request)
        # the call is active while its connection is: a worker that went away ends the call's waits
        active = lambda: not conn.error and conn.peer_open()  # noqa: E731
        context = CallContext(timeout_ms / 1000 if timeout_ms else None, active, conn.rank)
        code, body = run_call(self._handler, request, context, f"call {sequence} of rank {conn.rank}")
        with self._lock:  # before the answer: a worker that has it sees the call counted
            self.calls += 1
        self._answer(conn, sequence, code, body, context.time_remaining())

    @staticmethod
    def _answer(conn: Connection, sequence: int, code: int, body: dataconn.Body, timeout: float | None) -> None:
        timeout = max(1.0, SEND_SECONDS if timeout is None else timeout)
        conn.send(dataconn.answer(sequence, code, body), time.monotonic() + timeout)
