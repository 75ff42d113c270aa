"""ps_server.tables.reads: PullRows' reads on a thread of the lowest CPU priority, given up with their call."""

from __future__ import annotations

import os
import threading
import time
from concurrent import futures

import pytest

from ps_common.errors import ShuttingDownError, WaitTimeoutError
from ps_server.shard.waits import Call
from ps_server.tables.reads import NICE, TableReads, lower_priority


@pytest.fixture
def reads():
    pool = futures.ThreadPoolExecutor(1, "test-table-reads", initializer=lower_priority)
    yield TableReads(pool, shard_index=3)
    pool.shutdown(wait=True, cancel_futures=True)


def test_a_read_runs_at_the_lowest_priority_and_returns_its_result(reads) -> None:
    def work() -> tuple[int, int]:
        return threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    native, nice = reads.run(work)
    assert native != threading.get_native_id()  # not the caller's thread
    assert nice == NICE
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != NICE or NICE == 0


def test_an_error_of_the_read_is_raised_to_the_caller(reads) -> None:
    def work() -> None:
        raise ValueError("bad ids")

    with pytest.raises(ValueError, match="bad ids"):
        reads.run(work)


def busy(reads: TableReads, release: threading.Event) -> threading.Thread:
    """A thread whose read holds the read thread until ``release`` (returns once that read runs)."""
    started = threading.Event()
    thread = threading.Thread(target=lambda: reads.run(lambda: (started.set(), release.wait(10))), daemon=True)
    thread.start()
    assert started.wait(10)
    return thread


def test_a_read_queued_behind_another_is_dropped_when_its_deadline_passes(reads) -> None:
    release = threading.Event()
    ran: list[str] = []
    blocker = busy(reads, release)
    end = time.monotonic() + 0.3
    try:
        with Call(lambda: True, lambda: end - time.monotonic()), pytest.raises(WaitTimeoutError, match="Shard 3"):
            reads.run(lambda: ran.append("late"))
    finally:
        release.set()
        blocker.join(10)
    reads.run(lambda: None)  # the queue drained: the dropped read never ran
    assert ran == []


def test_a_cancelled_call_leaves_the_queue(reads) -> None:
    release = threading.Event()
    active = threading.Event()
    active.set()
    blocker = busy(reads, release)
    threading.Timer(0.3, active.clear).start()  # the client cancels while its read is queued
    try:
        with Call(active.is_set, lambda: None), pytest.raises(ShuttingDownError, match="cancelled"):
            reads.run(lambda: None)
    finally:
        release.set()
        blocker.join(10)
