"""The threads a shard server starts, recorded as they start and joined with a deadline at stop.

A shard process starts its threads in one place each (the lease reaper, the gRPC pools' workers;
the checkpointer joins its own writer), so that :meth:`ps_server.server.ShardServer.stop` can end
them all: two shards of the same index in one process (tests start such twins) name their threads
alike, so the threads are joined as recorded objects, never looked up by name.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures

log = logging.getLogger(__name__)


class OwnedThreads:
    """The threads of one shard server: named daemon threads and the workers of its pools.

    Thread-safe. A pool made by :meth:`pool` records each worker when the worker starts (through the
    executor's ``initializer``), so workers started lazily by later RPCs are known too.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def _record(self) -> None:
        with self._lock:
            self._threads.append(threading.current_thread())

    def pool(
        self, max_workers: int, name_prefix: str, initializer: Callable[[], None] | None = None
    ) -> futures.ThreadPoolExecutor:
        """A thread pool whose workers are named ``{name_prefix}_{n}`` and joined by :meth:`join`
        (shut the pool down first: :meth:`join` does not); each worker runs ``initializer`` first."""

        def start() -> None:
            self._record()
            if initializer is not None:
                initializer()

        return futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name_prefix, initializer=start)

    def start(self, target: Callable[[], None], name: str) -> threading.Thread:
        """Start ``target`` in a daemon thread called ``name`` and record it."""
        thread = threading.Thread(target=target, name=name, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()
        return thread

    def join(self, timeout: float, what: str) -> list[str]:
        """Join every recorded thread (but the caller's own) within ``timeout`` seconds in all.

        Args:
            timeout: seconds for all the joins together (>= 0).
            what: the owner, for the log line ("shard 0").

        Returns:
            The names of the threads still alive after the deadline (logged at WARNING), sorted.
        """
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        with self._lock:
            threads = [t for t in self._threads if t is not me]
        for thread in threads:
            if thread.ident is not None:  # recorded by start() just before it started
                thread.join(max(0.0, deadline - time.monotonic()))
        alive = sorted(t.name for t in threads if t.is_alive())
        if alive:
            log.warning("%s: %d thread(s) did not end within %.1f s: %s", what, len(alive), timeout, ", ".join(alive))
        return alive
