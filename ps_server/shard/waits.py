"""Waiting on a shard's condition with a deadline: for a version, a round, an SSP read bound or an
EASGD period, ending in a timeout, a closing shard, ranks that never joined, or the end of the call
the wait serves. A wait for other ranks that reaches the end of its call while they still count ends
in :class:`~ps_common.errors.AwaitingRanksError` (the worker calls again: the per-RPC deadline bounds
a call, not a slow peer; docs/architecture.md#12-membership).

The call: the service layer runs each request inside a :class:`Call` of two callables of its call
(grpc's ``context.is_active`` and ``context.time_remaining``, or a data connection's), and every
wait below re-checks them at least every :data:`WAKE_SECONDS`: a cancelled call, or one whose
deadline passed, ends its wait there and gives its thread back, whatever deadline the shard was
given. The callables are plain functions, so this module knows nothing of gRPC.
"""

from __future__ import annotations

import contextvars
import math
import threading
from collections.abc import Callable

from ps_common.errors import (
    AwaitingRanksError,
    RanksMissingError,
    ShuttingDownError,
    WaitTimeoutError,
    awaiting_message,
)
from ps_server.membership.ranks import Membership, WorkerState
from ps_server.policy.types import Awaited

WAKE_SECONDS = 0.25
"""Longest a wait sleeps between checks that its call is still active (so a cancelled call's
thread is back within about this long)."""


class Call:
    """The call a wait serves; ``with Call(active, remaining):`` runs its body as that call, so the
    waits in it end with the call.

    Args:
        active: whether the call is still wanted (False once it was cancelled, its deadline passed,
            or its connection closed; grpc's ``context.is_active``).
        remaining: seconds left before its deadline, None without one; values above 1e9 (grpc's
            answer for no deadline) count as None (grpc's ``context.time_remaining``).
    """

    __slots__ = ("active", "_remaining", "_token")

    def __init__(self, active: Callable[[], bool], remaining: Callable[[], float | None]) -> None:
        self.active = active
        self._remaining = remaining
        self._token: contextvars.Token[Call | None] | None = None

    def remaining(self) -> float | None:
        """Seconds left before the call's deadline, at least 0; None: no deadline."""
        value = self._remaining()
        return None if value is None or not math.isfinite(value) or value > 1e9 else max(0.0, value)

    def __enter__(self) -> Call:
        self._token = _CALL.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._token is not None:
                _CALL.reset(self._token)
        except ValueError:  # a generator closed from another context: that context ends with it
            pass


_CALL: contextvars.ContextVar[Call | None] = contextvars.ContextVar("ps_server_call", default=None)


def current_call() -> Call | None:
    """The call the running code serves (None outside a :class:`Call`: waits end only on their
    deadline or the shard's close)."""
    return _CALL.get()


class Waits:
    """The waits of one shard on its condition ``cond`` (the caller holds it).

    Args:
        cond: the shard's condition; every change of state notifies it.
        now: the shard's monotonic clock, in seconds.
        shard_index: for messages.
    """

    def __init__(self, cond: threading.Condition, now: Callable[[], float], shard_index: int) -> None:
        self._cond = cond
        self._now = now
        self.shard_index = shard_index
        self.closed = False

    def close(self) -> None:
        """Wake every waiter with ShuttingDownError (caller holds the condition)."""
        self.closed = True
        self._cond.notify_all()

    def check_open(self) -> None:
        """Refuse an update once the shard is closing: its final checkpoint may be taken already,
        and an update applied after it (a push completing a round) would be answered and then lost
        with the restart.

        Raises:
            ShuttingDownError: the shard is closing (UNAVAILABLE: the worker retries against its restart).
        """
        if self.closed:
            raise ShuttingDownError(f"Shard {self.shard_index} is shutting down; retry against its restart.")

    def until(self, ready: Callable[[], bool], deadline: float | None, describe: Callable[[], str]) -> None:
        """Wait until ``ready()``, at most until ``deadline`` and while the call served (see
        :class:`Call`) is active and within its own deadline.

        Args:
            deadline: on the shard's clock (seconds); None waits until the shard closes or the call ends.
            describe: the timeout's message (why it is blocked, what to check).

        Raises:
            ShuttingDownError: the shard is closing. WaitTimeoutError: ``deadline`` or the call's
                deadline passed, or the call was cancelled (its answer then reaches no one).
        """
        call = current_call()
        if call is not None:
            left = call.remaining()
            if left is not None:
                end = self._now() + left
                deadline = end if deadline is None else min(deadline, end)
        while not ready():
            self.check_open()
            remaining = None if deadline is None else deadline - self._now()
            if remaining is not None and remaining <= 0:
                raise WaitTimeoutError(describe())
            if call is not None:
                if not call.active():
                    raise WaitTimeoutError(
                        f"The call ended (cancelled, or past its deadline) while waiting: {describe()}"
                    )
                remaining = WAKE_SECONDS if remaining is None else min(remaining, WAKE_SECONDS)
            self._cond.wait(remaining)

    def for_ranks(
        self,
        ready: Callable[[], bool],
        deadline: float | None,
        describe: Callable[[], str],
        membership: Membership,
        report_missing: Callable[[], list[int]],
        quorum: Callable[[], int] = lambda: 0,
        awaited: Callable[[], Awaited | None] | None = None,
    ) -> None:
        """:meth:`until` for a round or read that needs every expected rank: once the join
        deadline passes with ranks that never joined (and the others cannot close rounds on a
        quorum of their own), it fails instead of waiting on.

        Args:
            membership: the shard's ranks and their join deadline.
            report_missing: reports and returns the ranks that never joined.
            quorum: pushes that close a round whoever sent them now (0: every expected rank).
            awaited: whom the wait waits for when its deadline comes (None: no rank).

        Raises:
            AwaitingRanksError: the deadline came while ``awaited()`` names ranks that still count
                (alive, or not joined yet within the join timeout): the caller calls again.
            RanksMissingError: ranks never joined within the join timeout, and it is still not
                ready then. ShuttingDownError, WaitTimeoutError: as :meth:`until`.
        """
        try:
            self._for_ranks(ready, deadline, describe, membership, report_missing, quorum)
        except WaitTimeoutError:
            self._still_awaited(membership, awaited, describe)
            raise

    def until_awaited(
        self,
        ready: Callable[[], bool],
        deadline: float | None,
        describe: Callable[[], str],
        membership: Membership,
        awaited: Callable[[], Awaited | None],
    ) -> None:
        """:meth:`until` for a wait on other ranks with no join deadline (a sync table round).

        Raises:
            AwaitingRanksError: as :meth:`for_ranks`. ShuttingDownError, WaitTimeoutError: as :meth:`until`.
        """
        try:
            self.until(ready, deadline, describe)
        except WaitTimeoutError:
            self._still_awaited(membership, awaited, describe)
            raise

    def _still_awaited(
        self, membership: Membership, awaited: Callable[[], Awaited | None] | None, describe: Callable[[], str]
    ) -> None:
        """Raise AwaitingRanksError when ``awaited()`` names ranks that all joined (a wait just
        timed out; a rank that never joined is waited for no longer than before: the call times
        out, and ``--join-timeout`` applies); its message ends with ``describe()``."""
        found = None if awaited is None else awaited()
        if found is not None and found.ranks and not _not_joined(found, membership):
            text = awaiting_message(found.what, found.ranks, _state(found, membership))
            raise AwaitingRanksError(f"Shard {self.shard_index} is {text}. {describe()}") from None

    def _for_ranks(
        self,
        ready: Callable[[], bool],
        deadline: float | None,
        describe: Callable[[], str],
        membership: Membership,
        report_missing: Callable[[], list[int]],
        quorum: Callable[[], int],
    ) -> None:
        due = membership.joins.due()
        if due is not None and (deadline is None or due < deadline):
            try:
                return self.until(ready, due, describe)
            except WaitTimeoutError:
                missing = report_missing()
                k = quorum()  # K of N: the others can close rounds
                if missing and not (k and len(membership.expected()) - len(missing) >= k):
                    raise RanksMissingError(membership.joins.describe(missing, self.shard_index)) from None
        self.until(ready, deadline, describe)


def _not_joined(found: Awaited, membership: Membership) -> bool:
    """Whether an awaited rank has not joined this shard yet."""
    members = membership.members
    return any(r >= len(members) or members[r].state is WorkerState.PENDING for r in found.ranks)


def _state(found: Awaited, membership: Membership) -> str:
    """What the awaited ranks are: ``are alive but have not pushed`` when every one is live here
    (heartbeating within its lease), else which are alive and which are silent (evicted here or
    gone, and still counted until shard 0's decision arrives)."""
    by_state: dict[str, list[int]] = {"alive": [], "silent": []}
    for r in found.ranks:
        by_state["alive" if membership.members[r].state is WorkerState.LIVE else "silent"].append(r)
    if len(by_state["alive"]) == len(found.ranks):
        return f"are alive but have not {found.missing}"
    shown = ", ".join(f"{k}: {v}" for k, v in by_state.items() if v)
    return f"have not {found.missing} ({shown})"
