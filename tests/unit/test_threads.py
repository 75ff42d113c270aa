"""ps_server.threads: recorded threads are joined within one deadline; stragglers are named."""

from __future__ import annotations

import logging
import threading

import pytest

from ps_server.threads import OwnedThreads


def test_join_ends_started_threads_and_pool_workers() -> None:
    owned = OwnedThreads()
    stop = threading.Event()
    thread = owned.start(lambda: stop.wait(10), "waiter-0")
    pool = owned.pool(2, "pool0")
    assert pool.submit(threading.current_thread).result(timeout=10).name.startswith("pool0_")
    pool.shutdown(wait=False)
    stop.set()
    assert owned.join(10, "test") == []
    assert not thread.is_alive()


def test_join_names_the_threads_still_alive(caplog: pytest.LogCaptureFixture) -> None:
    owned = OwnedThreads()
    stop = threading.Event()
    owned.start(lambda: stop.wait(10), "stuck-0")
    try:
        with caplog.at_level(logging.WARNING, logger="ps_server.threads"):
            assert owned.join(0.05, "shard 3") == ["stuck-0"]
        assert "shard 3: 1 thread(s) did not end within 0.1 s: stuck-0" in caplog.text
    finally:
        stop.set()
        assert owned.join(10, "test") == []
