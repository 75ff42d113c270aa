"""retry_call: transient codes are retried with jittered backoff until the deadline, others raise at once."""

from __future__ import annotations

import grpc
import pytest

from ps_worker.retry import backoff_delays, retry_call


class Failure(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name


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
    assert retry_call(fn, 60.0, "test", sleep=slept.append) == "ok"
    assert len(calls) == 5 and len(slept) == 4
    assert all(0 <= s <= min(2.0, 0.05 * 2**i) for i, s in enumerate(slept))


def test_other_codes_raise_at_once() -> None:
    fn, calls = flaky([grpc.StatusCode.INVALID_ARGUMENT])
    with pytest.raises(Failure):
        retry_call(fn, 60.0, "test", sleep=lambda s: pytest.fail("slept"))
    assert len(calls) == 1


def test_the_deadline_ends_retries() -> None:
    fn, calls = flaky([grpc.StatusCode.UNAVAILABLE] * 100)
    with pytest.raises(Failure):
        retry_call(fn, 0.0, "test", sleep=lambda s: None)
    assert len(calls) == 1  # the first backoff would already pass a deadline of 0 s


def test_backoff_is_bounded_full_jitter() -> None:
    delays = backoff_delays(base=0.1, cap=0.4)
    assert all(0 <= next(delays) <= min(0.4, 0.1 * 2**i) for i in range(20))
