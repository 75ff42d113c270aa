"""A worker's waits for other ranks across per-RPC deadlines (docs/architecture.md#12-membership).

A sync pull or PushPull waits at the shard for the other ranks' pushes of its round (an SSP read for
the slowest rank, a sync EASGD exchange for its period, a sync table read for its table round).
The per-RPC deadline bounds one call, not a slow peer: when the call's deadline comes while the
ranks it waits for are alive (heartbeating within their leases), the shard answers
``DEADLINE_EXCEEDED`` with reason ``AWAITING_RANKS`` (:class:`~ps_common.errors.AwaitingRanksError`)
and :class:`PeerWaits` calls again. A Pull is idempotent; a PushPull or Exchange called again
carries the same stamp, so the shard answers its push as a duplicate (applied once) and waits again.
Meanwhile a progress line names the awaited ranks at most every :data:`PROGRESS_SECONDS`, e.g.
``rank 1: waiting for round 42: ranks [0] are alive but have not pushed (75 s)``.

A rank that goes silent is evicted when its lease lapses; the round then closes without it and the
wait ends as any round does. A rank alive but stuck (its heartbeat thread runs, its main thread is
deadlocked) is bounded by ``wait_timeout`` (``PS_WAIT_TIMEOUT``, default :data:`DEFAULT_WAIT_TIMEOUT`
seconds, as gloo's default timeout): after it, :class:`~ps_worker.errors.AwaitingRanks` names the
ranks. It is checked when the shard answers, so the wait ends within one per-RPC deadline after it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from ps_common.errors import Reason, parse_awaiting
from ps_worker.errors import AwaitingRanks, error_from_rpc, reason_of

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_WAIT_TIMEOUT = 1800.0
"""Seconds a wait for alive ranks may last in all (gloo's default timeout is 30 minutes)."""

PROGRESS_SECONDS = 30.0
"""Least seconds between two progress lines of one worker."""


def wait_bound(wait_timeout: float | None) -> float | None:
    """``wait_timeout`` checked: None or 0 wait forever while the awaited ranks are alive.

    Raises:
        ValueError: negative or not a number.
    """
    if wait_timeout is None or wait_timeout == 0:
        return None
    if not wait_timeout > 0 or math.isnan(wait_timeout):
        raise ValueError(f"wait_timeout must be >= 0 seconds (0: no bound while alive), got {wait_timeout!r}.")
    return float(wait_timeout)


class PeerWaits:
    """Calls that wait for other ranks, called again while those ranks are alive.

    Args:
        rank: this worker's rank (for the progress lines).
        wait_timeout: seconds one wait may last in all; None or 0: no bound while the ranks are alive.
        progress_seconds: least seconds between two progress lines.
        now: monotonic clock, seconds.

    Attributes:
        reissued: calls made again because the ranks they waited for were alive.

    Raises:
        ValueError: a negative ``wait_timeout``.
    """

    def __init__(
        self,
        rank: int,
        wait_timeout: float | None = DEFAULT_WAIT_TIMEOUT,
        progress_seconds: float = PROGRESS_SECONDS,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rank = rank
        self.wait_timeout = wait_bound(wait_timeout)
        self.progress_seconds = progress_seconds
        self._now = now
        self._lock = threading.Lock()  # one call per shard runs in parallel
        self._logged = -math.inf
        self.reissued = 0

    def call(self, fn: Callable[[], T], address: str) -> T:
        """``fn()``, called again each time it fails with ``AWAITING_RANKS``, until it returns or
        fails otherwise, or :attr:`wait_timeout` seconds passed since this call began.

        Args:
            fn: one call to the shard at ``address``, safe to repeat.

        Raises:
            AwaitingRanks: still waiting for alive ranks after ``wait_timeout`` (names them).
            grpc.RpcError: any other failure of ``fn``, as it raised it.
        """
        start = self._now()
        while True:
            try:
                return fn()
            except grpc.RpcError as exc:
                if reason_of(exc) != Reason.AWAITING_RANKS:
                    raise
                self._awaiting(exc, address, self._now() - start)

    def _awaiting(self, exc: grpc.RpcError, address: str, elapsed: float) -> None:
        """Log progress and return (call again), or raise AwaitingRanks past the bound."""
        err = error_from_rpc(address, exc, waits=True)
        what, ranks, state = parse_awaiting(err.details()) or ("other ranks", [], "are alive")
        bound = self.wait_timeout
        if bound is not None and elapsed >= bound:
            raise AwaitingRanks(
                address,
                err.code(),
                err.details(),
                err.trailing_metadata(),
                message=(
                    f"rank {self.rank}: gave up waiting for {what} after {elapsed:.0f} s (wait_timeout "
                    f"{bound:g} s, PS_WAIT_TIMEOUT): ranks {ranks} {state} (shard {address}). A rank alive but "
                    "not stepping may be stuck (its heartbeat runs, its training loop does not): check it, or "
                    "raise wait_timeout (0: wait while it is alive)."
                ),
            ) from exc
        with self._lock:
            self.reissued += 1
            now = self._now()
            if now - self._logged < self.progress_seconds:
                return
            self._logged = now
        log.warning("rank %d: waiting for %s: ranks %s %s (%.0f s)", self.rank, what, ranks, state, elapsed)
