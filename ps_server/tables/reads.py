"""Embedding-table reads (PullRows) on a thread of their own, at the lowest CPU priority.

A PullRows of two million ids costs the shard a few hundred milliseconds of CPU (decoding and
sorting the ids, finding their rows, making the rows nobody has written yet, copying the answer),
however briefly it holds the shard's lock (``ps_server.tables.row_read``). On a small machine three
clients looping such pulls took every core from the dense data path: dense training fell to a
twentieth of its step rate although the lock was free most of the time. So the shard runs the
reads' work on :data:`READ_THREADS` thread(s) whose Linux scheduling priority is the lowest (nice
19; lowering a thread's own priority needs no privilege): a read takes the CPU the dense path
leaves, pulls queue behind each other instead of multiplying, and a dense step never waits for a
core behind a table read. A chunk of a read still holds the shard's lock for at most
``READ_CHUNK_IDS`` ids at a time.

The caller's handler thread waits for its read (a waiting call: ``ps_server.service.waiting_calls``) and
gives up with the call: cancelled, or past its deadline, it leaves the queue and the read, if it had
not started, never runs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent import futures
from typing import TypeVar

from ps_common.errors import ShuttingDownError, WaitTimeoutError
from ps_server.shard.waits import WAKE_SECONDS, current_call

log = logging.getLogger(__name__)

T = TypeVar("T")

READ_THREADS = 1
"""Threads that run table reads per shard: reads queue behind each other, at nice :data:`NICE`."""
NICE = 19
"""The reads' Linux nice value (the lowest priority)."""


def lower_priority() -> None:
    """Give the calling thread the lowest CPU priority (Linux: threads have nice values of their own).
    Where that is not possible, the thread keeps its priority and says so once."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (OSError, AttributeError) as exc:  # not Linux, or a sandbox that forbids it
        log.warning("table reads keep the shard's CPU priority (%s): large PullRows compete with pushes", exc)


class TableReads:
    """Runs table reads on ``pool`` (threads that called :func:`lower_priority`), one call's at a time
    per thread.

    Args:
        pool: the reads' threads (:data:`READ_THREADS`, made by the server so it joins them at stop).
        shard_index: for messages.
    """

    def __init__(self, pool: futures.ThreadPoolExecutor, shard_index: int = 0) -> None:
        self.pool = pool
        self.shard_index = shard_index

    def run(self, work: Callable[[], T]) -> T:
        """Run ``work`` on a read thread and return its result, or raise what it raised.

        Waits as the call it serves allows (``ps_server.shard.waits.current_call``: its deadline, its
        cancellation), re-checking every ``WAKE_SECONDS``.

        Raises:
            WaitTimeoutError: the call's deadline passed before the read ended (a read not yet
                started is dropped). ShuttingDownError: the call was cancelled or the pool stopped.
        """
        call = current_call()
        try:
            future = self.pool.submit(work)
        except RuntimeError as exc:  # the pool shut down: the shard is stopping
            raise ShuttingDownError(f"Shard {self.shard_index} is shutting down; retry against its restart.") from exc
        while True:
            remaining = call.remaining() if call is not None else None
            step = WAKE_SECONDS if remaining is None else min(WAKE_SECONDS, remaining)
            try:
                return future.result(timeout=step)
            except futures.TimeoutError:
                if future.done():  # the read's own error (a WaitTimeoutError is a TimeoutError too)
                    raise
            if call is not None and not call.active():
                future.cancel()
                raise ShuttingDownError(f"Shard {self.shard_index}: the PullRows was cancelled before it was read.")
            if remaining is not None and remaining <= step:
                future.cancel()
                raise WaitTimeoutError(
                    f"Shard {self.shard_index}: the PullRows waited past its deadline behind other table reads; "
                    "give it a longer deadline or pull fewer ids per call."
                )
