"""CallPolicy: transient codes (a busy shard's RESOURCE_EXHAUSTED too) are retried with jittered backoff
until the deadline, others raise at once; the error names the deadline that ended the call."""

from __future__ import annotations

import time

import grpc
import pytest

from ps_common.errors import StatusError
from ps_worker.awaiting import PeerWaits
from ps_worker.transport.retry import (
    MAX_RECOVERIES,
    RETRY_DEADLINE,
    TIMEOUT,
    CallPolicy,
    backoff_delays,
    is_transient,
)


class Failure(StatusError):
    """A failed call's error, as grpcio raises them (its code, details and ``ps-reason``)."""

    def __init__(self, code: grpc.StatusCode, details: str = "", reason: str = "") -> None:
        super().__init__(code, details or code.name, (("ps-reason", reason),) if reason else ())


def flaky(codes: list[grpc.StatusCode]):
    calls = []

    def fn() -> str:
        calls.append(1)
        if codes:
            raise Failure(codes.pop(0))
        return "ok"

    return fn, calls


def test_transient_codes_are_retried_with_growing_sleeps() -> None:
    fn, calls = flaky([grpc.StatusCode.UNAVAILABLE] * 3 + [grpc.StatusCode.DEADLINE_EXCEEDED])
    slept: list[float] = []
    assert CallPolicy(60.0, sleep=slept.append).call(fn, "test") == "ok"
    assert len(calls) == 5 and len(slept) == 4
    assert all(0 <= s <= min(2.0, 0.05 * 2**i) for i, s in enumerate(slept))


def test_other_codes_raise_at_once() -> None:
    fn, calls = flaky([grpc.StatusCode.INVALID_ARGUMENT])
    with pytest.raises(Failure):
        CallPolicy(60.0, sleep=lambda s: pytest.fail("slept")).call(fn, "test")
    assert len(calls) == 1


def test_the_deadline_ends_retries() -> None:
    fn, calls = flaky([grpc.StatusCode.UNAVAILABLE] * 100)
    with pytest.raises(Failure):
        CallPolicy(0.0, sleep=lambda s: None).call(fn, "test")
    assert len(calls) == 1  # the first backoff would already pass a deadline of 0 s


def test_backoff_is_bounded_full_jitter() -> None:
    delays = backoff_delays(base=0.1, cap=0.4)
    assert all(0 <= next(delays) <= min(0.4, 0.1 * 2**i) for i in range(20))


def test_a_busy_shard_is_retried_with_backoff() -> None:
    """gRPC's own refusal past ``maximum_concurrent_rpcs`` is transient: retried with growing sleeps."""
    busy = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")
    failures = [busy] * 4
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return "ok"

    slept: list[float] = []
    assert CallPolicy(60.0, sleep=slept.append).call(fn, "test") == "ok"
    assert len(calls) == 5 and len(slept) == 4
    assert all(0 <= s <= min(2.0, 0.05 * 2**i) for i, s in enumerate(slept))


@pytest.mark.parametrize(
    "failure",
    [
        Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (17000000 vs. 16777216)"),
        Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "Sent message larger than max (17000000 vs. 16777216)"),
        Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "This shard already serves 16 streams", reason="TOO_MANY_STREAMS"),
    ],
    ids=["received-too-large", "sent-too-large", "shard-limit-with-reason"],
)
def test_a_limit_on_the_request_itself_raises_at_once(failure: Failure) -> None:
    assert not is_transient(failure)
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        raise failure

    with pytest.raises(Failure):
        CallPolicy(60.0, sleep=lambda s: pytest.fail("slept")).call(fn, "test")
    assert len(calls) == 1


def test_codes_narrow_what_is_retried() -> None:
    busy = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")
    assert is_transient(busy)
    assert not is_transient(busy, codes={grpc.StatusCode.UNAVAILABLE})
    assert is_transient(Failure(grpc.StatusCode.UNAVAILABLE))
    assert not is_transient(Failure(grpc.StatusCode.FAILED_PRECONDITION))


def test_a_shard_holding_its_most_waiting_calls_is_busy_not_refusing() -> None:
    """``TOO_MANY_WAITS`` (``--max-waiting-calls``): the waiting calls end with their rounds or
    deadlines, so the worker retries, as for gRPC's own concurrency limit."""
    busy = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-waiting-calls 12 reached", reason="TOO_MANY_WAITS")
    assert is_transient(busy)
    failures = [busy] * 2
    slept: list[float] = []

    def fn() -> str:
        if failures:
            raise failures.pop(0)
        return "ok"

    assert CallPolicy(60.0, sleep=slept.append).call(fn, "test") == "ok" and len(slept) == 2


def test_the_error_names_the_deadline_that_ended_the_call() -> None:
    fn, _ = flaky([grpc.StatusCode.UNAVAILABLE] * 100)
    with pytest.raises(Failure) as unreachable:
        CallPolicy(0.0, sleep=lambda s: None).call(fn, "test")
    assert unreachable.value.deadline == RETRY_DEADLINE  # transient failures until --retry-deadline
    fn, _ = flaky([grpc.StatusCode.DEADLINE_EXCEEDED])
    with pytest.raises(Failure) as slow:
        CallPolicy(0.0, sleep=lambda s: None).call(fn, "test")
    assert slow.value.deadline == TIMEOUT  # the one attempt ran out of its per-RPC --timeout
    fn, _ = flaky([grpc.StatusCode.DEADLINE_EXCEEDED] * 100)
    policy = CallPolicy(0.5, sleep=lambda s: time.sleep(0.05))
    with pytest.raises(Failure) as retried:
        policy.call(fn, "test")
    assert retried.value.deadline == RETRY_DEADLINE  # retried, each attempt's deadline, until --retry-deadline
    fn, _ = flaky([grpc.StatusCode.INVALID_ARGUMENT])
    with pytest.raises(Failure) as refused:
        CallPolicy(60.0).call(fn, "test")
    assert refused.value.deadline is None  # a refusal: no deadline


def test_the_policy_waits_and_recovers_in_one_loop_each_bounded() -> None:
    waits = PeerWaits(1, wait_timeout=0.0)  # no bound while alive
    awaiting = [
        Failure(grpc.StatusCode.DEADLINE_EXCEEDED, "waiting for round 4: ranks [0] are alive;", "AWAITING_RANKS")
    ]
    fn, calls = flaky([grpc.StatusCode.UNAVAILABLE])
    answers = iter(awaiting)

    def waiting() -> str:
        for exc in answers:
            raise exc
        return fn()

    assert CallPolicy(60.0, sleep=lambda s: None).call(waiting, "test", address="h:1", waits=waits) == "ok"
    assert waits.reissued == 1 and len(calls) == 2
    recovered: list[grpc.RpcError] = []
    fn, calls = flaky([grpc.StatusCode.FAILED_PRECONDITION] * 100)
    with pytest.raises(Failure) as caught:
        CallPolicy(60.0).call(fn, "test", recover=lambda err: recovered.append(err) or True)
    assert len(recovered) == MAX_RECOVERIES and len(calls) == MAX_RECOVERIES + 1 and caught.value.deadline is None
