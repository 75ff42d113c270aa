"""The counters of one shard: pushes, refused pushes by reason, push staleness and bytes, kept once.

Admin/GetStatus (``rejected_pushes``, ``staleness``, ``received_bytes``, ``sent_bytes``,
``rejected_requests``) and Prometheus (``ps_pushes_total``, ``ps_rejected_pushes_total``,
``ps_push_staleness``, ``ps_received_bytes_total``, ``ps_sent_bytes_total``, exported by
:class:`ps_server.metrics.CountersCollector`) read the same numbers, so ``ps-admin`` and a scrape cannot disagree.

Who counts what, each event once:

- the shard (its policy) counts the refusals it decides: ``stale`` (a gradient past
  ``--max-staleness``, a push for a closed sync round), ``replayed``, ``late`` (dropped by a quorum
  round), ``non_finite_update``/``update_failed``/``hyperparameters_disagree`` (once per rank of a
  refused round), and the reports ``round_timeout`` and ``join_timeout``;
- the servicer tells :meth:`ShardCounters.pushed` every accepted push;
- the metrics interceptor counts bytes by method, and the refusals of push calls the shard did not
  count (:data:`SHARD_REASONS`), by status code (``invalid_argument``, ``unauthenticated``, ...).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from ps_common.errors import Reason
from ps_server.membership.ranks import PushResult

RECEIVED_METHODS = frozenset(
    f"ps.v1.ParameterService/{name}" for name in ("Init", "Push", "PushPull", "PushPullOnce", "Exchange")
)
"""The calls whose request bytes GetStatus reports as ``received_bytes`` (the partitions workers send)."""

SENT_METHODS = frozenset(f"ps.v1.ParameterService/{name}" for name in ("Pull", "PushPull", "PushPullOnce", "Exchange"))
"""The calls whose response bytes GetStatus reports as ``sent_bytes`` (the partitions workers read)."""

SHARD_REASONS = frozenset(
    str(r)
    for r in (
        Reason.STALE,
        Reason.REPLAYED,
        Reason.NON_FINITE_UPDATE,
        Reason.UPDATE_FAILED,
        Reason.HYPERPARAMETERS_DISAGREE,
    )
)
"""``ps-reason`` of the refusals the shard counts itself; the interceptor counts the others."""


@dataclass(frozen=True)
class CountersView:
    """One consistent read of :class:`ShardCounters`."""

    pushes: dict[str, int]
    rejected_pushes: dict[str, int]
    staleness: dict[int, int]
    received_bytes: dict[str, int]
    sent_bytes: dict[str, int]
    rejected_requests: int
    streamed_rounds: dict[str, int]
    """Sync rounds streamed (:mod:`ps_server.shard.round_stream`), by outcome: ``streamed`` (closed as
    streamed), ``put_back`` (the stream ended first; the round was applied at its close)."""

    def data_bytes(self) -> tuple[int, int]:
        """(received, sent) bytes of partition traffic (:data:`RECEIVED_METHODS`, :data:`SENT_METHODS`):
        sums of ``ps_received_bytes_total`` and ``ps_sent_bytes_total`` over those methods."""
        return (
            sum(n for m, n in self.received_bytes.items() if m in RECEIVED_METHODS),
            sum(n for m, n in self.sent_bytes.items() if m in SENT_METHODS),
        )


class ShardCounters:
    """Thread-safe counters of one shard (see the module docstring for who counts what)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pushes: Counter[str] = Counter()
        self._rejected_pushes: Counter[str] = Counter()
        self._staleness: Counter[int] = Counter()
        self._received: Counter[str] = Counter()
        self._sent: Counter[str] = Counter()
        self._rejected_requests = 0
        self._streamed: Counter[str] = Counter()

    def streamed(self, outcome: str) -> None:
        """Count a streamed round's outcome (``streamed`` or ``put_back``)."""
        with self._lock:
            self._streamed[outcome] += 1

    def refuse(self, reason: str, count: int = 1) -> None:
        """Count ``count`` refused (or dropped) pushes for ``reason`` (snake case)."""
        with self._lock:
            self._rejected_pushes[reason] += count

    def pushed(self, result: PushResult) -> None:
        """Count an accepted push by mode and its staleness (a duplicate once)."""
        if result.duplicate:
            return
        with self._lock:
            self._pushes[result.mode] += 1
            self._staleness[result.staleness] += 1

    def transferred(self, method: str, received: int = 0, sent: int = 0) -> None:
        """Count serialized message bytes of ``method`` (full name, ``ps.v1.ParameterService/Push``)."""
        with self._lock:
            if received:
                self._received[method] += received
            if sent:
                self._sent[method] += sent

    def add(self, rejected: int = 0) -> None:
        """Count refused requests (any call, any reason: the status's ``rejected_requests``)."""
        with self._lock:
            self._rejected_requests += rejected

    @property
    def rejected(self) -> int:
        """Requests refused so far."""
        with self._lock:
            return self._rejected_requests

    def view(self) -> CountersView:
        """A consistent copy of every counter."""
        with self._lock:
            return CountersView(
                dict(self._pushes),
                dict(self._rejected_pushes),
                dict(self._staleness),
                dict(self._received),
                dict(self._sent),
                self._rejected_requests,
                dict(self._streamed),
            )
