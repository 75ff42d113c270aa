"""PeerWaits: a wait for alive ranks is called again, logged at most every progress_seconds, and
bounded by wait_timeout. No sleeping, no sockets: a fake clock that moves with each call."""

from __future__ import annotations

import logging
import threading

import grpc
import pytest

from ps_common.errors import AwaitingRanksError, RoundTimeoutError, WaitTimeoutError, awaiting_message
from ps_worker.awaiting import TICKER, PeerWaits, wait_bound
from ps_worker.transport.retry import CallPolicy, is_transient
from tests.unit.test_worker_errors import FakeRpcError

AWAITING = FakeRpcError(
    grpc.StatusCode.DEADLINE_EXCEEDED,
    "Shard 0 is " + awaiting_message("round 42", [0, 2], "are alive but have not pushed"),
    "AWAITING_RANKS",
)


def call(waits: PeerWaits, fn, address: str):
    """``fn`` called again while the shard at ``address`` answers AWAITING_RANKS (no other retry)."""
    return CallPolicy(0.0).call(fn, address, address=address, codes=(), waits=waits)


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
        assert call(waits, fn, "h:1") == "answer"
    assert len(made) == 8 and waits.reissued == 7
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "rank 1: waiting for round 42: ranks [0, 2] are alive but have not pushed (10 s)",
        "rank 1: waiting for round 42: ranks [0, 2] are alive but have not pushed (40 s)",
        "rank 1: waiting for round 42: ranks [0, 2] are alive but have not pushed (70 s)",
    ]


def test_a_wait_is_logged_every_progress_seconds_before_the_shard_answers(caplog) -> None:
    """The shard answers AWAITING_RANKS only at the call's deadline (60 s by default): the progress
    lines come every 30 s all the same (issue 44 saw the first at 59 s), naming the ranks once known."""
    clock = Clock()
    waits = PeerWaits(1, wait_timeout=None, progress_seconds=30.0, now=clock)
    seen = []

    ticks = [[29.0, 30.0, 45.0, 59.5], [60.0, 90.0]]  # the progress thread's, while each call is in flight

    def fn() -> str:
        for t in ticks.pop(0):
            clock.t = t
            seen.append(waits.progress())
        if ticks:
            raise AWAITING  # at the first call's deadline
        return "answer"

    with caplog.at_level(logging.WARNING, logger="ps_worker.awaiting"):
        assert call(waits, fn, "h:1") == "answer"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "rank 1: waiting for shard h:1 (30 s); it names the ranks it waits for at the call's deadline",
        "rank 1: waiting for round 42: ranks [0, 2] are alive but have not pushed (60 s)",
        "rank 1: waiting for round 42: ranks [0, 2] are alive but have not pushed (90 s)",
    ]
    assert seen == [1.0, 30.0, 15.0, 0.5, 30.0, 30.0]
    assert waits.progress() == 30.0  # nothing in flight: nothing to say


def test_the_progress_thread_writes_the_line_of_a_call_still_in_flight(caplog) -> None:
    """With the real clock, one daemon thread writes the line while the call is still blocked."""
    waits = PeerWaits(1, wait_timeout=None, progress_seconds=0.2)
    written = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            written.set()

    handler = Seen(logging.WARNING)
    logger = logging.getLogger("ps_worker.awaiting")
    logger.addHandler(handler)
    try:
        assert call(waits, lambda: written.wait(timeout=10.0), "h:2") is True  # blocks until the line
    finally:
        logger.removeHandler(handler)
    assert TICKER._thread is not None and TICKER._thread.daemon


def test_the_wait_gives_up_after_wait_timeout_naming_the_ranks() -> None:
    clock = Clock()
    waits = PeerWaits(1, wait_timeout=25.0, now=clock)
    fn, made = calls(clock, failures=100)
    with pytest.raises(AwaitingRanksError) as caught:
        call(waits, fn, "h:1")
    err = caught.value
    assert len(made) == 3 and clock.t == 30.0  # ends at the first answer past the bound
    assert isinstance(err, WaitTimeoutError) and isinstance(err, RoundTimeoutError) and isinstance(err, TimeoutError)
    assert err.ranks == [0, 2] and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and err.address == "h:1"
    assert str(err).startswith("rank 1: gave up waiting for round 42 after 30 s (wait_timeout 25 s, PS_WAIT_TIMEOUT)")


def test_other_failures_pass_through_and_awaiting_is_not_retried_as_transient() -> None:
    other = FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Version 3 not reached", "WAIT_TIMEOUT")

    def fn() -> str:
        raise other

    with pytest.raises(FakeRpcError) as caught:
        call(PeerWaits(0), fn, "h:1")
    assert caught.value is other
    assert is_transient(other) and not is_transient(AWAITING)


@pytest.mark.parametrize(("given", "bound"), [(None, None), (0, None), (0.0, None), (5, 5.0), (1800.0, 1800.0)])
def test_wait_timeout_zero_or_none_means_no_bound(given, bound) -> None:
    assert wait_bound(given) == bound


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_a_negative_wait_timeout_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="wait_timeout must be >= 0"):
        PeerWaits(0, wait_timeout=bad)


def test_giving_up_names_wait_timeout_as_the_deadline() -> None:
    clock = Clock()
    fn, _ = calls(clock, failures=100)
    with pytest.raises(AwaitingRanksError) as caught:
        call(PeerWaits(1, wait_timeout=25.0, now=clock), fn, "h:1")
    assert caught.value.deadline == "wait_timeout"
