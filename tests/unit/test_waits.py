"""Waits on a shard's condition: ready, timed out with the caller's words, or closed. No sleeping:
an injected clock that moves on each wait."""

from __future__ import annotations

import threading

import pytest

from ps_common.errors import (
    AwaitingRanksError,
    RanksMissingError,
    ShuttingDownError,
    WaitTimeoutError,
    parse_awaiting,
)
from ps_server.membership.ranks import Membership, WorkerState
from ps_server.policy.types import Awaited
from ps_server.shard.waits import WAKE_SECONDS, Call, Waits, current_call


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


def test_a_wait_ends_when_its_call_is_cancelled() -> None:
    """A wait with no deadline of its own re-checks its call every WAKE_SECONDS and ends once the
    call is no longer active (cancelled by the client, or its connection closed)."""
    clock = Clock()
    cond = StepCondition(clock)
    waits = Waits(cond, clock, 3)
    checks = iter([True, True, False])
    with cond, Call(lambda: next(checks), lambda: None):
        with pytest.raises(WaitTimeoutError, match="The call ended .* round 7 waits"):
            waits.until(lambda: False, None, lambda: "round 7 waits for ranks [1]")
    assert cond.waits == 2 and clock.t == 2 * WAKE_SECONDS  # never slept longer than WAKE_SECONDS


def test_a_wait_ends_at_its_calls_deadline_even_when_the_shard_gave_none() -> None:
    clock = Clock()
    cond = StepCondition(clock)
    waits = Waits(cond, clock, 3)
    with cond, Call(lambda: True, lambda: 0.6):
        with pytest.raises(WaitTimeoutError, match="not durable"):
            waits.until(lambda: False, None, lambda: "not durable")
        assert clock.t == pytest.approx(0.6)
        with pytest.raises(WaitTimeoutError):  # an earlier deadline of the shard's still wins
            waits.until(lambda: False, clock.t + 0.1, lambda: "earlier")
        assert clock.t == pytest.approx(0.7)


def test_a_call_scopes_the_waits_and_no_deadline_reads_as_none() -> None:
    assert current_call() is None
    with Call(lambda: True, lambda: 1e30) as outer:  # grpc's "no deadline"
        assert current_call() is outer and outer.remaining() is None
        with Call(lambda: False, lambda: -3.0) as inner:
            assert current_call() is inner and inner.remaining() == 0.0 and not inner.active()
        assert current_call() is outer
    assert current_call() is None


def test_a_wait_outside_any_call_sleeps_until_its_deadline() -> None:
    """Without a call (a checkpoint's wait, a unit test) nothing changes: one sleep to the deadline."""
    clock = Clock()
    cond = StepCondition(clock)
    waits = Waits(cond, clock, 3)
    with cond, pytest.raises(WaitTimeoutError):
        waits.until(lambda: False, 5.0, lambda: "late")
    assert cond.waits == 1


def test_a_wait_for_alive_ranks_ends_at_its_deadline_saying_who_it_waits_for() -> None:
    """The call's deadline bounds the call, not the peers: the shard says which ranks it waits for
    and that they are alive, so the worker calls again (ps_worker.awaiting)."""
    clock = Clock()
    cond = StepCondition(clock)
    membership = Membership(3, 10.0, clock)
    membership.members[0].state = WorkerState.LIVE
    membership.members[2].state = WorkerState.LIVE
    waits = Waits(cond, clock, 1)
    round_ = Awaited("round 42", [0], "pushed")
    with cond:
        with pytest.raises(AwaitingRanksError) as caught:
            waits.for_ranks(lambda: False, 2.0, lambda: "x", membership, lambda: [], awaited=lambda: round_)
        assert parse_awaiting(caught.value.args[0]) == ("round 42", [0], "are alive but have not pushed")
        assert str(caught.value).startswith("Shard 1 is waiting for round 42: ranks [0] are alive")
        membership.members[2].state = WorkerState.EVICTED  # silent here, still counted by shard 0
        mixed = Awaited("table round 3", [0, 2], "pushed rows")
        with pytest.raises(AwaitingRanksError, match=r"\[0, 2\] have not pushed rows \(alive: \[0\], silent: \[2\]\);"):
            waits.until_awaited(lambda: False, clock.t + 1, lambda: "x", membership, lambda: mixed)
        for never_joined in (Awaited("round 42", [0, 1], "pushed"), None):  # as before: the call times out
            with pytest.raises(WaitTimeoutError) as plain:
                waits.for_ranks(
                    lambda: False, clock.t + 1, lambda: "late", membership, lambda: [], awaited=lambda a=never_joined: a
                )
            assert type(plain.value) is WaitTimeoutError
