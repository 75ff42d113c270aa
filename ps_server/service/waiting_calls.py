"""The data plane's waiting calls, kept off the threads that Health, Admin and Join need, and bounded.

grpc's sync server runs a handler in a pool thread for the handler's whole life. The calls of
``ps.v1.ParameterService`` that can last (a Pull or PushPull waiting for its sync round, a PullRows
for the next table version, an InitTables of rank r > 0 waiting for rank 0's tables, a client
stream such as Push, PushPull or Init that has not sent its last message) would otherwise hold the
threads of the one pool, and a client with the worker token could take all of them: Health, Admin
and Join would then wait behind it (``DEADLINE_EXCEEDED``). So:

- Those methods (:data:`WAITING_METHODS`) run in a pool of their own (grpc's
  ``experimental_thread_pool``, as :mod:`ps_server.service.streams` does for long-lived streams); Join,
  Heartbeat, Leave, PushRows, Admin, Health and reflection keep the server's pool.
- At most ``limit`` of them run at once (``--max-waiting-calls``; by default two per worker plus 8,
  where sync training needs one per worker and shard). One more is refused at once with
  ``RESOURCE_EXHAUSTED``, the trailing ``ps-reason: TOO_MANY_WAITS`` (workers retry it with backoff)
  and a message naming the flag. The pool has a few threads beyond ``limit`` that answer refusals.
- Each call's waits end when the call is cancelled or its deadline passes
  (:class:`ps_server.shard.waits.Call`), and its slot is freed when its handler ends or the call ends,
  whichever comes first.
- A request stream (Init, Push, PushPull, Exchange) must send its first message within
  ``first_message_seconds`` (min(10 s, the lease timeout)), or the call is cancelled and its slot
  freed: a stream that never sends its header holds a slot no longer than that.
- With per-rank credentials (``--rank-tokens``, :mod:`ps_server.service.rank_tokens`) each rank's own
  calls take a share of their own (``rank_share`` slots per rank); the calls of the shared worker
  token and the admin token share ``limit``. A rank that holds its whole share is refused its next
  call; it cannot take another rank's slots, nor can the holders of the shared token.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from ps_common.errors import REASON_KEY, Reason
from ps_server.service.chain import Behavior
from ps_server.service.rank_tokens import RANK, caller_of

SERVICE = "/ps.v1.ParameterService/"
WAITING_METHODS = frozenset(
    {"Init", "Push", "Pull", "PushPull", "PushPullOnce", "Exchange", "InitTables", "PullRows"}
    | {"PullOptimizerState", "PushOptimizerState"}
)
"""ParameterService methods whose handlers can last: they wait on the shard, or read a client stream."""
REFUSAL_THREADS = 4
"""Threads of the waiting calls' pool beyond the limit: they refuse extra calls at once."""
FLAG = "--max-waiting-calls"
FIRST_MESSAGE_SECONDS = 10.0
"""Most seconds a request stream's first message is awaited (less when the lease timeout is shorter)."""


def rank_share(limit: int, num_workers: int) -> int:
    """Waiting calls each rank with its own token may hold at once: ``max(4, limit // num_workers)``
    (a sync worker holds one per shard, plus a retry or a table read)."""
    return max(4, limit // max(1, num_workers))


class Alarms:
    """One thread that calls each armed callback at its time unless it was disarmed first (the
    first-message bound of request streams; a timer thread per call would cost a thread start per
    push).

    Args:
        start: starts the alarms' thread (e.g. :meth:`ps_server.threads.OwnedThreads.start`
            with a name); called once, at the first :meth:`arm`.
    """

    def __init__(self, start: Callable[[Callable[[], None]], Any]) -> None:
        self._start = start
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, list[Callable[[], None] | None]]] = []
        self._order = itertools.count()
        self._started = False
        self._closed = False

    def arm(self, seconds: float, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (in the alarms' thread) in ``seconds``; returns the disarm (idempotent)."""
        slot: list[Callable[[], None] | None] = [callback]
        with self._cond:
            if self._closed:
                return lambda: None
            heapq.heappush(self._heap, (time.monotonic() + seconds, next(self._order), slot))
            if not self._started:
                self._started = True
                self._start(self._run)
            self._cond.notify()

        def disarm() -> None:
            slot[0] = None

        return disarm

    def close(self) -> None:
        """Stop the thread; pending alarms never ring."""
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    while self._heap and self._heap[0][2][0] is None:
                        heapq.heappop(self._heap)
                    if not self._heap:
                        self._cond.wait()
                        continue
                    due = self._heap[0][0] - time.monotonic()
                    if due <= 0:
                        callback = heapq.heappop(self._heap)[2][0]
                        break
                    self._cond.wait(due)
            if callback is not None:
                callback()


class WaitingCalls:
    """Run :data:`WAITING_METHODS` in ``pool``, at most ``limit`` at once (and ``rank_share`` per
    rank with its own token).

    A stage of the shard's interceptor (:mod:`ps_server.service.chain`), inside the token check, so
    that a refused token never takes a slot and a rank's token is known
    (:func:`ps_server.service.rank_tokens.caller_of`).

    Args:
        limit: waiting calls admitted at once (>= 1) of callers that are no rank of their own (the
            shared worker token, the admin token, no token).
        pool: where they run: ``limit + ranks * rank_share + REFUSAL_THREADS`` threads, so that an
            admitted call never waits for a thread and a refusal is answered at once.
        shard_index: for messages.
        rank_share: waiting calls admitted at once per rank calling with its own token (0: no
            per-rank shares; every call counts in ``limit``).
        first_message_seconds: most seconds a request stream's first message is awaited before the
            call is cancelled (None: no bound).
        alarms: what cancels those calls (needed with ``first_message_seconds``).
    """

    def __init__(
        self,
        limit: int,
        pool: futures.ThreadPoolExecutor,
        shard_index: int = 0,
        rank_share: int = 0,
        first_message_seconds: float | None = None,
        alarms: Alarms | None = None,
    ) -> None:
        self.limit = limit
        self.pool = pool
        self.shard_index = shard_index
        self.rank_share = rank_share
        self.first_message_seconds = first_message_seconds
        self.alarms = alarms
        if first_message_seconds is not None and alarms is None:
            raise ValueError("first_message_seconds needs alarms, which cancel the calls that sent nothing")
        self.open = 0
        """Calls admitted and not yet ended (of every caller)."""
        self.shared = 0
        """Calls admitted under ``limit`` and not yet ended."""
        self.by_rank: dict[int, int] = {}
        """Calls admitted per rank under its share and not yet ended."""
        self.refused = 0
        """Calls refused because their cap was reached."""
        self.cut = 0
        """Request streams cancelled because their first message did not come in time."""
        self._lock = threading.Lock()

    def _acquire(self, rank: int | None) -> bool:
        with self._lock:
            if rank is None:
                if self.shared >= self.limit:
                    self.refused += 1
                    return False
                self.shared += 1
            else:
                if self.by_rank.get(rank, 0) >= self.rank_share:
                    self.refused += 1
                    return False
                self.by_rank[rank] = self.by_rank.get(rank, 0) + 1
            self.open += 1
            return True

    def _release(self, rank: int | None) -> None:
        with self._lock:
            self.open -= 1
            if rank is None:
                self.shared -= 1
            elif self.by_rank[rank] <= 1:
                del self.by_rank[rank]
            else:
                self.by_rank[rank] -= 1

    def _slot(self, context: grpc.ServicerContext) -> Callable[[], None]:
        """Take a slot or abort the call; returns the slot's release (idempotent), which also runs
        when the call ends (cancelled, past its deadline)."""
        caller = caller_of(context)
        rank = caller.rank if self.rank_share and caller is not None and caller.kind == RANK else None
        if not self._acquire(rank):
            context.set_trailing_metadata(((REASON_KEY, str(Reason.TOO_MANY_WAITS)),))
            if rank is not None:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Rank {rank} already holds its share of {self.rank_share} calls that wait on shard "
                    f"{self.shard_index} (--rank-tokens: each rank has its own share, max(4, {FLAG} / "
                    "num_workers)). Retry with backoff once one of its calls ended; give every call a deadline.",
                )
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{FLAG} {self.limit} reached: shard {self.shard_index} already holds {self.limit} calls that wait "
                "(pushes and pulls for their rounds, table reads, client streams not finished). Retry with "
                f"backoff, give every call a deadline, or raise {FLAG} (PS_MAX_WAITING_CALLS).",
            )
        once = threading.Lock()

        def release() -> None:
            if once.acquire(blocking=False):
                self._release(rank)

        if not context.add_callback(release):  # the call has already ended
            release()
        return release

    def _first_in_time(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        """``request_iterator``, the call cancelled when its first message does not come within
        ``first_message_seconds``."""
        seconds, alarms = self.first_message_seconds, self.alarms
        if seconds is None or alarms is None:
            yield from request_iterator
            return

        def cut() -> None:
            with self._lock:
                self.cut += 1
            context.cancel()

        disarm = alarms.arm(seconds, cut)
        try:
            for message in request_iterator:
                disarm()
                yield message
        finally:
            disarm()

    def _unary_response(self, behavior: Callable[..., Any], streaming: bool = False) -> Callable[..., Any]:
        def handle(request: Any, context: grpc.ServicerContext) -> Any:
            release = self._slot(context)
            if streaming:
                request = self._first_in_time(request, context)
            try:
                return behavior(request, context)
            finally:
                release()

        handle.experimental_thread_pool = self.pool  # type: ignore[attr-defined]
        return handle

    def _stream_response(self, behavior: Callable[..., Any], streaming: bool = False) -> Callable[..., Any]:
        def handle(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            release = self._slot(context)
            if streaming:
                request = self._first_in_time(request, context)
            try:
                yield from behavior(request, context)
            finally:
                release()

        handle.experimental_thread_pool = self.pool  # type: ignore[attr-defined]
        return handle

    def wrap(self, method: str, handler: grpc.RpcMethodHandler, behavior: Behavior) -> Behavior:
        """The stage (:data:`ps_server.service.chain.Stage`): a call of :data:`WAITING_METHODS`
        admitted under its cap, in ``pool``; the others as they are."""
        if not method.startswith(SERVICE) or method[len(SERVICE) :] not in WAITING_METHODS:
            return behavior
        wrap = self._stream_response if handler.response_streaming else self._unary_response
        return wrap(behavior, bool(handler.request_streaming))
