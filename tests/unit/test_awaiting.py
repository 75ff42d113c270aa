"""PeerWaits: a wait for alive ranks is called again, logged at most every progress_seconds, and
bounded by wait_timeout. No sleeping, no sockets: a fake clock that moves with each call."""

from __future__ import annotations

import logging

import grpc
import pytest

from ps_common.errors import awaiting_message
from ps_worker.awaiting import PeerWaits, wait_bound
from ps_worker.errors import AwaitingRanks, RoundTimeoutError, WaitTimeout
from ps_worker.transport.retry import is_transient
from tests.unit.test_worker_errors import FakeRpcError

AWAITING = FakeRpcError(
    grpc.StatusCode.DEADLINE_EXCEEDED,
    "Shard 0 is " + awaiting_message("round 42", [0, 2], "are alive but have not pushed"),
    "AWAITING_RANKS",
)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def calls(clock: Clock, failures: int, seconds: float = 10.0):
    """A call that waits ``seconds`` and fails AWAITING_RANKS ``failures`` times, then answers."""
    made = []

    def fn() -> str:
        made.append(clock.t)
        clock.t += seconds
        if len(made) <= failures:
            raise AWAITING
        return "answer"

    return fn, made


def test_a_wait_for_alive_ranks_is_called_again_and_logged_every_progress_seconds(caplog) -> None:
    clock = Clock()
    waits = PeerWaits(1, wait_timeout=None, progress_seconds=30.0, now=clock)
    fn, made = calls(clock, failures=7)
    with caplog.at_level(logging.WARNING, logger="ps_worker.awaiting"):
        assert waits.call(fn, "h:1") == "answer"
    assert len(made) == 8 and waits.reissued == 7
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "rank 1: waiting for round 42: ranks [0, 2] are alive but have not pushed (10 s)",
        "rank 1: waiting for round 42: ranks [0, 2] are alive but have not pushed (40 s)",
        "rank 1: waiting for round 42: ranks [0, 2] are alive but have not pushed (70 s)",
    ]


def test_the_wait_gives_up_after_wait_timeout_naming_the_ranks() -> None:
    clock = Clock()
    waits = PeerWaits(1, wait_timeout=25.0, now=clock)
    fn, made = calls(clock, failures=100)
    with pytest.raises(AwaitingRanks) as caught:
        waits.call(fn, "h:1")
    err = caught.value
    assert len(made) == 3 and clock.t == 30.0  # ends at the first answer past the bound
    assert isinstance(err, WaitTimeout) and isinstance(err, RoundTimeoutError) and isinstance(err, TimeoutError)
    assert err.ranks == [0, 2] and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and err.address == "h:1"
    assert str(err).startswith("rank 1: gave up waiting for round 42 after 30 s (wait_timeout 25 s, PS_WAIT_TIMEOUT)")


def test_other_failures_pass_through_and_awaiting_is_not_retried_as_transient() -> None:
    other = FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Version 3 not reached", "WAIT_TIMEOUT")

    def fn() -> str:
        raise other

    with pytest.raises(FakeRpcError) as caught:
        PeerWaits(0).call(fn, "h:1")
    assert caught.value is other
    assert is_transient(other) and not is_transient(AWAITING)


@pytest.mark.parametrize(("given", "bound"), [(None, None), (0, None), (0.0, None), (5, 5.0), (1800.0, 1800.0)])
def test_wait_timeout_zero_or_none_means_no_bound(given, bound) -> None:
    assert wait_bound(given) == bound


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_a_negative_wait_timeout_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="wait_timeout must be >= 0"):
        PeerWaits(0, wait_timeout=bad)
