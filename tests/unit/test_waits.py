"""Waits on a shard's condition: ready, timed out with the caller's words, or closed. No sleeping:
an injected clock that moves on each wait."""

from __future__ import annotations

import threading

import pytest

from ps_common.errors import RanksMissingError, ShuttingDownError, WaitTimeoutError
from ps_server.membership import Membership
from ps_server.waits import Waits


class Clock:
    """Seconds that pass only when a wait times out (the condition's wait returns at once)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class StepCondition(threading.Condition):
    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        self.clock.t += timeout if timeout is not None else 1.0
        return False


def test_a_ready_wait_returns_at_once_and_a_timeout_says_why() -> None:
    clock = Clock()
    cond = StepCondition(clock)
    waits = Waits(cond, clock, 3)
    with cond:
        waits.until(lambda: True, 0.0, lambda: "never")
        assert cond.waits == 0
        with pytest.raises(WaitTimeoutError, match="round 7 waits for ranks"):
            waits.until(lambda: False, 2.0, lambda: "round 7 waits for ranks [1]")
    assert clock.t == 2.0


def test_a_closed_shard_wakes_its_waiters() -> None:
    clock = Clock()
    cond = StepCondition(clock)
    waits = Waits(cond, clock, 3)
    with cond:
        waits.close()
        with pytest.raises(ShuttingDownError, match="Shard 3 is shutting down"):
            waits.until(lambda: False, None, lambda: "never")


def test_ranks_that_never_joined_fail_the_wait_unless_a_quorum_can_close_rounds() -> None:
    clock = Clock()
    cond = StepCondition(clock)
    membership = Membership(3, 10.0, clock, join_timeout=5.0)
    membership.joins.start()
    waits = Waits(cond, clock, 0)
    with cond:
        with pytest.raises(RanksMissingError):
            waits.for_ranks(lambda: False, 60.0, lambda: "x", membership, lambda: [1, 2])
        with pytest.raises(WaitTimeoutError):  # K = 1 of 3: the joined rank can close rounds alone
            waits.for_ranks(lambda: False, 60.0, lambda: "x", membership, lambda: [1, 2], quorum=lambda: 1)
