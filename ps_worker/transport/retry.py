"""The one retry policy of a worker's calls (:class:`CallPolicy`): transient gRPC failures again with
exponential backoff and full jitter, waits for alive ranks again (:mod:`ps_worker.awaiting`),
recoveries (:meth:`ps_worker.session.Session.recover`); the error raised names the deadline that
ended the call (``err.deadline``: :data:`TIMEOUT`, :data:`RETRY_DEADLINE` or :data:`WAIT_TIMEOUT`)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection
from typing import TypeVar

import grpc

from ps_common.errors import REASON_KEY, Reason, reason_of  # noqa: F401 - REASON_KEY re-exported
from ps_worker.awaiting import PeerWaits

log = logging.getLogger(__name__)
T = TypeVar("T")
E = TypeVar("E", bound=BaseException)

_jitter = random.Random()
"""Shared by every backoff: seeding a new Random from os.urandom per call cost ~15 µs per RPC."""

RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
)
"""Transient codes: the shard is restarting or unreachable, the call ran out of time, or the shard is
busy (``RESOURCE_EXHAUSTED`` from gRPC's limit of concurrent calls; see :func:`is_transient`)."""


TOO_LARGE = "larger than max"
"""gRPC's words for a message over ``grpc.max_*_message_length``: retrying would send it again."""


def backoff_delays(base: float = 0.05, cap: float = 2.0, rng: random.Random | None = None):
    """Infinite generator of sleep times: uniform in [0, min(cap, base * 2**attempt)] seconds
    ("full jitter", as in the AWS architecture blog's exponential backoff study)."""
    rng = rng or _jitter
    attempt = 0
    while True:
        yield rng.uniform(0, min(cap, base * (2**attempt)))
        attempt += 1


def is_transient(exc: grpc.RpcError, codes: Collection[grpc.StatusCode] = RETRYABLE) -> bool:
    """True when ``exc`` is worth retrying: its code is in ``codes`` and, for ``RESOURCE_EXHAUSTED``,
    it is an overload (gRPC's "Concurrent RPC limit exceeded", no reason attached) rather than a limit
    on the request itself (a message over the size limit, or a shard's refusal with a ``ps-reason``,
    e.g. ``TOO_MANY_STREAMS``), which would be refused again. A shard's ``TOO_MANY_WAITS`` is an
    overload too: its waiting calls end with their rounds or deadlines. ``AWAITING_RANKS`` is not
    transient: the wait for alive ranks is called again by :class:`ps_worker.awaiting.PeerWaits`,
    which bounds it with ``wait_timeout`` instead of the retry deadline."""
    code = exc.code() if hasattr(exc, "code") else None
    if code is grpc.StatusCode.CANCELLED and grpc.StatusCode.UNAVAILABLE in codes:
        # the shard cancelled it (a call in flight when the shard stopped, past its grace): as UNAVAILABLE;
        # a call this process cancelled itself ("Locally cancelled") is not made again
        return "locally cancelled" not in _details(exc).lower()
    if code not in codes:
        return False
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return reason_of(exc) != Reason.AWAITING_RANKS
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return reason_of(exc) in ("", Reason.TOO_MANY_WAITS) and TOO_LARGE not in _details(exc)
    return True


TIMEOUT = "timeout"
"""The per-RPC deadline (``--timeout``, ``PSClient(timeout=...)``) ended the call's last attempt."""
RETRY_DEADLINE = "retry_deadline"
"""Transient failures were retried until ``--retry-deadline`` (``PSClient(retry_deadline=...)``) passed."""
WAIT_TIMEOUT = "wait_timeout"
"""The ranks the call waited for stayed alive but did not step within ``wait_timeout`` (``PS_WAIT_TIMEOUT``)."""

MAX_RECOVERIES = 3
"""Recoveries (rejoin, re-init, resync) one call may go through before its error is raised."""


class CallPolicy:
    """The one retry policy of a worker's calls to the shards: every call's attempts, waits and
    recoveries go through :meth:`call`, and the error it raises names the deadline that ended the
    call in its ``deadline`` attribute (:data:`TIMEOUT`, :data:`RETRY_DEADLINE`, :data:`WAIT_TIMEOUT`;
    None: a refusal, no deadline).

    Args:
        retry_deadline: seconds to keep retrying transient failures (:func:`is_transient`), from
            the call's start or its last wait or recovery.
        sleep: how a backoff sleeps (:func:`backoff_delays`).
    """

    def __init__(self, retry_deadline: float, sleep: Callable[[float], None] = time.sleep) -> None:
        self.retry_deadline = retry_deadline
        self.sleep = sleep

    def call(
        self,
        fn: Callable[[], T],
        what: str,
        *,
        address: str = "",
        codes: Collection[grpc.StatusCode] = RETRYABLE,
        waits: PeerWaits | None = None,
        error: Callable[[grpc.RpcError], grpc.RpcError] | None = None,
        recover: Callable[[grpc.RpcError], bool] | None = None,
    ) -> T:
        """``fn()`` until it returns: transient failures (``codes``) again with backoff until the retry
        deadline; an ``AWAITING_RANKS`` answer again while ``waits`` allows (each time with a whole
        retry deadline); a refusal ``recover`` fixed again, at most :data:`MAX_RECOVERIES` times.

        Args:
            fn: one attempt, safe to repeat (pushes resend the same (rank, incarnation, clock)).
            what: the call, for the log. address: the shard's ``host:port``.
            waits: calls again what waits for alive ranks (None: such an answer is raised).
            error: the error to raise (and recover from) for a failure (None: the failure itself).
            recover: brings the session back in step after a refusal; True: call again.

        Raises:
            grpc.RpcError: ``error(failure)`` of the last failure, its ``deadline`` set.
        """
        wait = waits.begin(address) if waits is not None else None
        stop, delays, recovered = time.monotonic() + self.retry_deadline, None, 0
        try:
            while True:
                try:
                    return fn()
                except grpc.RpcError as exc:
                    if waits is not None and reason_of(exc) == Reason.AWAITING_RANKS:
                        try:
                            waits.awaiting(exc, wait)
                        except grpc.RpcError as gave_up:
                            raise _ended(gave_up, WAIT_TIMEOUT) from exc
                        stop, delays = time.monotonic() + self.retry_deadline, None
                        continue
                    code = exc.code() if hasattr(exc, "code") else None
                    ended = TIMEOUT if code is grpc.StatusCode.DEADLINE_EXCEEDED else None
                    if is_transient(exc, codes):
                        retried, delays = delays is not None, delays or backoff_delays()
                        delay = next(delays)
                        if time.monotonic() + delay <= stop:
                            log.info(
                                "%s: %s (%s); retrying in %.2f s",
                                what,
                                code.name if code else "?",
                                _details(exc),
                                delay,
                            )
                            self.sleep(delay)
                            continue
                        ended = RETRY_DEADLINE if retried or ended is None else ended
                    err = error(exc) if error is not None else exc
                    if recover is not None and recovered < MAX_RECOVERIES and recover(err):
                        recovered += 1
                        stop, delays = time.monotonic() + self.retry_deadline, None
                        if waits is not None:  # the wait starts again with the recovered call
                            waits.end(wait)
                            wait = waits.begin(address)
                        continue
                    _ended(err, ended)
                    if err is exc:
                        raise
                    raise err from exc
        finally:
            if waits is not None:
                waits.end(wait)


def _ended(exc: E, deadline: str | None) -> E:
    """``exc``, its ``deadline`` set."""
    exc.deadline = deadline  # type: ignore[attr-defined]
    return exc


def _details(exc: grpc.RpcError) -> str:
    return (exc.details() if hasattr(exc, "details") else str(exc)) or ""
