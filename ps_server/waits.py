"""Waiting on a shard's condition with a deadline: for a version, a round, an SSP read bound or an
EASGD period, ending in a timeout, a closing shard, or ranks that never joined."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ps_common.errors import RanksMissingError, ShuttingDownError, WaitTimeoutError
from ps_server.membership import Membership


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

    def until(self, ready: Callable[[], bool], deadline: float | None, describe: Callable[[], str]) -> None:
        """Wait until ``ready()``.

        Args:
            deadline: on the shard's clock (seconds); None waits until the shard closes.
            describe: the timeout's message (why it is blocked, what to check).

        Raises:
            ShuttingDownError: the shard is closing. WaitTimeoutError: ``deadline`` passed.
        """
        while not ready():
            if self.closed:
                raise ShuttingDownError(f"Shard {self.shard_index} is shutting down; retry against its restart.")
            remaining = None if deadline is None else deadline - self._now()
            if remaining is not None and remaining <= 0:
                raise WaitTimeoutError(describe())
            self._cond.wait(remaining)

    def for_ranks(
        self,
        ready: Callable[[], bool],
        deadline: float | None,
        describe: Callable[[], str],
        membership: Membership,
        report_missing: Callable[[], list[int]],
        quorum: Callable[[], int] = lambda: 0,
    ) -> None:
        """:meth:`until` for a round or read that needs every expected rank: once the join
        deadline passes with ranks that never joined (and the others cannot close rounds on a
        quorum of their own), it fails instead of waiting on.

        Args:
            membership: the shard's ranks and their join deadline.
            report_missing: reports and returns the ranks that never joined.
            quorum: pushes that close a round whoever sent them now (0: every expected rank).

        Raises:
            RanksMissingError: ranks never joined within the join timeout, and it is still not
                ready then. ShuttingDownError, WaitTimeoutError: as :meth:`until`.
        """
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
