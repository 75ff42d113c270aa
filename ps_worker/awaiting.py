"""A worker's waits for other ranks across per-RPC deadlines (docs/architecture.md#12-membership).

A sync pull or PushPull waits at the shard for the other ranks' pushes of its round (an SSP read for
the slowest rank, a sync EASGD exchange for its period, a sync table read for its table round).
The per-RPC deadline bounds one call, not a slow peer: when the call's deadline comes while the
ranks it waits for are alive (heartbeating within their leases), the shard answers
``DEADLINE_EXCEEDED`` with reason ``AWAITING_RANKS`` (:class:`~ps_common.errors.AwaitingRanksError`)
and :class:`PeerWaits` calls again. A Pull is idempotent; a PushPull or Exchange called again
carries the same stamp, so the shard answers its push as a duplicate (applied once) and waits again.
Meanwhile a progress line comes every :data:`PROGRESS_SECONDS` of a wait, written by one daemon
thread per process (:class:`Ticker`), since the shard answers only at the call's deadline (60 s by
default): ``rank 1: waiting for round 42: ranks [0] are alive but have not pushed (75 s)`` once the
shard named the ranks, ``rank 1: waiting for shard HOST:PORT (30 s); it names ...`` before.

A rank that goes silent is evicted when its lease lapses; the round then closes without it and the
wait ends as any round does. A rank alive but stuck (its heartbeat thread runs, its main thread is
deadlocked) is bounded by ``wait_timeout`` (``PS_WAIT_TIMEOUT``, default :data:`DEFAULT_WAIT_TIMEOUT`
seconds, as gloo's default timeout): after it, :class:`~ps_common.errors.AwaitingRanksError` names the
ranks. It is checked when the shard answers, so the wait ends within one per-RPC deadline after it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Callable

import grpc

from ps_common.errors import AwaitingRanksError, parse_awaiting
from ps_worker.errors import error_from_rpc

log = logging.getLogger(__name__)

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
        now: monotonic clock, seconds. With another clock than ``time.monotonic`` no thread writes the
            progress lines: the caller calls :meth:`progress`.

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
        self._waiting: dict[int, _Wait] = {}  # the calls in flight
        self._ticked = now is time.monotonic
        self.reissued = 0

    def begin(self, address: str) -> _Wait:
        """A call to the shard at ``address`` that may wait begins (its progress lines from now on)."""
        wait = _Wait(address, self._now())
        with self._lock:
            self._waiting[id(wait)] = wait
        if self._ticked:
            TICKER.watch(self)
        return wait

    def end(self, wait: _Wait) -> None:
        """The call of ``wait`` is over."""
        with self._lock:
            self._waiting.pop(id(wait), None)

    def progress(self) -> float:
        """Log a progress line when a call has waited :attr:`progress_seconds`, and as long as it
        waits, one every :attr:`progress_seconds` (the ranks named once the shard named them).

        Returns:
            Seconds until a line may be due next.
        """
        with self._lock:
            if not self._waiting:
                return self.progress_seconds
            wait = min(self._waiting.values(), key=lambda w: w.start)
            now = self._now()
            due = max(wait.start, self._logged) + self.progress_seconds
            if now < due:
                return due - now
            self._logged = now
        if wait.named is None:
            log.warning(
                "rank %d: waiting for shard %s (%.0f s); it names the ranks it waits for at the call's deadline",
                self.rank,
                wait.address,
                now - wait.start,
            )
        else:
            log.warning("rank %d: waiting for %s: ranks %s %s (%.0f s)", self.rank, *wait.named, now - wait.start)
        return self.progress_seconds

    def awaiting(self, exc: grpc.RpcError, wait: _Wait) -> None:
        """The shard answered ``exc`` (AWAITING_RANKS) to the call of ``wait``: log progress and return
        (call again), or raise AwaitingRanks past the bound.

        Raises:
            AwaitingRanks: still waiting for alive ranks after ``wait_timeout`` (names them)."""
        address, elapsed = wait.address, self._now() - wait.start
        err = error_from_rpc(address, exc, waits=True)
        what, ranks, state = wait.named = parse_awaiting(err.details()) or ("other ranks", [], "are alive")
        bound = self.wait_timeout
        if bound is not None and elapsed >= bound:
            raise AwaitingRanksError(
                f"rank {self.rank}: gave up waiting for {what} after {elapsed:.0f} s (wait_timeout "
                f"{bound:g} s, PS_WAIT_TIMEOUT): ranks {ranks} {state} (shard {address}). A rank alive but "
                "not stepping may be stuck (its heartbeat runs, its training loop does not): check it, or "
                "raise wait_timeout (0: wait while it is alive).",
                address=address,
                code=err.code(),
                details=err.details(),
                metadata=err.trailing_metadata(),
            ) from exc
        with self._lock:
            self.reissued += 1
            now = self._now()
            if now - self._logged < self.progress_seconds:
                return
            self._logged = now
        log.warning("rank %d: waiting for %s: ranks %s %s (%.0f s)", self.rank, what, ranks, state, elapsed)


class _Wait:
    """One waiting call in flight (:meth:`PeerWaits.begin`): its shard, start (seconds) and, once the
    shard answered AWAITING_RANKS, what it waits for (what, ranks, state)."""

    __slots__ = ("address", "start", "named")

    def __init__(self, address: str, start: float) -> None:
        self.address, self.start = address, start
        self.named: tuple[str, list[int], str] | None = None


class Ticker:
    """The daemon thread that writes every :class:`PeerWaits`' progress lines on time (one per
    process, started by the first wait; it holds the waits weakly)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._watched: weakref.WeakSet[PeerWaits] = weakref.WeakSet()
        self._thread: threading.Thread | None = None

    def watch(self, waits: PeerWaits) -> None:
        """Write ``waits``' progress lines from now on (a no-op once it is watched)."""
        if waits in self._watched:
            return
        with self._changed:
            self._watched.add(waits)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ps-wait-progress", daemon=True)
                self._thread.start()
            self._changed.notify()

    def _run(self) -> None:
        while True:
            with self._changed:
                watched = list(self._watched)
            delay = min((w.progress() for w in watched), default=PROGRESS_SECONDS)
            with self._changed:
                self._changed.wait(max(delay, 0.05))


TICKER = Ticker()
"""The process's progress thread."""
