"""Retries of transient gRPC failures with exponential backoff and full jitter."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection
from typing import TypeVar

import grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

_jitter = random.Random()
"""Shared by every backoff: seeding a new Random from os.urandom per call cost ~15 µs per RPC."""

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Transient codes: the shard is restarting or unreachable, or the call ran out of time."""


def backoff_delays(base: float = 0.05, cap: float = 2.0, rng: random.Random | None = None):
    """Infinite generator of sleep times: uniform in [0, min(cap, base * 2**attempt)] seconds
    ("full jitter", as in the AWS architecture blog's exponential backoff study)."""
    rng = rng or _jitter
    attempt = 0
    while True:
        yield rng.uniform(0, min(cap, base * (2**attempt)))
        attempt += 1


def retry_call(
    fn: Callable[[], T],
    deadline: float,
    what: str,
    codes: Collection[grpc.StatusCode] = RETRYABLE,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``fn`` until it succeeds, retrying ``codes`` until ``deadline`` seconds from now.

    ``fn`` must be safe to repeat (pushes resend the same (rank, incarnation, clock)).

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
            if code not in codes or time.monotonic() + delay > stop:
                raise
            log.info("%s: %s (%s); retrying in %.2f s", what, code.name if code else "?", _details(exc), delay)
            sleep(delay)


def _details(exc: grpc.RpcError) -> str:
    return exc.details() if hasattr(exc, "details") else str(exc)
