"""Retries of transient gRPC failures with exponential backoff and full jitter."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection
from typing import TypeVar

import grpc

from ps_common.errors import REASON_KEY, Reason, reason_of  # noqa: F401 - REASON_KEY re-exported

log = logging.getLogger(__name__)
T = TypeVar("T")

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
    if code not in codes:
        return False
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return reason_of(exc) != Reason.AWAITING_RANKS
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return reason_of(exc) in ("", Reason.TOO_MANY_WAITS) and TOO_LARGE not in _details(exc)
    return True


def retry_call(
    fn: Callable[[], T],
    deadline: float,
    what: str,
    codes: Collection[grpc.StatusCode] = RETRYABLE,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``fn`` until it succeeds, retrying ``codes`` until ``deadline`` seconds from now.

    ``fn`` must be safe to repeat (pushes resend the same (rank, incarnation, clock)). Which errors
    are retried: :func:`is_transient`; sleeps between attempts: :func:`backoff_delays`.

    Raises:
        grpc.RpcError: a non-retryable code, or the last error once the deadline has passed.
    """
    stop = time.monotonic() + deadline
    delays = None  # made on the first failure: the common case needs no backoff generator
    while True:
        try:
            return fn()
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            delays = delays or backoff_delays()
            delay = next(delays)
            if not is_transient(exc, codes) or time.monotonic() + delay > stop:
                raise
            log.info("%s: %s (%s); retrying in %.2f s", what, code.name if code else "?", _details(exc), delay)
            sleep(delay)


def _details(exc: grpc.RpcError) -> str:
    return (exc.details() if hasattr(exc, "details") else str(exc)) or ""
