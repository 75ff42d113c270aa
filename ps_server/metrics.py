"""Prometheus metrics of a shard (DESIGN section 10), built against an injected registry.

Every name here is contract. Counters and histograms are updated by
:class:`ps_server.interceptors.MetricsInterceptor`; the gauges that mirror shard state
(``ps_model_version``, ``ps_workers``) are read from ``Shard.status()`` at scrape time by
:class:`ShardCollector`, so there is no second copy of that state to drift.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ps_server.shard import StatusView

log = logging.getLogger(__name__)

RPC_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
"""Seconds; up to 60 s because a sync Pull may wait a whole round (the worker's default deadline)."""

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)
"""Versions (async) or clocks (ssp) between a gradient's base and the version it was applied to."""

CHECKPOINT_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

CHECKPOINT_FAILURE_REASONS = ("no_space", "permission", "not_a_directory", "io_error", "other")
"""Values of the ``reason`` label of ``ps_checkpoint_failures_total`` (``checkpoint.failure_reason``);
every one is exported from the start, zeros included, so a first failure shows in ``increase()``."""

WORKER_STATES = ("pending", "live", "evicted", "left")
"""Values of the ``state`` label of ``ps_workers``; every one is exported, zeros included."""


class ShardCollector(Collector):
    """``ps_model_version`` and ``ps_workers{state}``, read from one status snapshot per scrape.

    Args:
        status: returns the shard's current :class:`~ps_server.shard.StatusView` (``Shard.status``).
    """

    def __init__(self, status: Callable[[], StatusView]) -> None:
        self._status = status

    def describe(self) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("ps_model_version", _VERSION_HELP),
            GaugeMetricFamily("ps_workers", _WORKERS_HELP, labels=["state"]),
        ]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        view = self._status()
        yield GaugeMetricFamily("ps_model_version", _VERSION_HELP, value=view.version)
        counts = dict.fromkeys(WORKER_STATES, 0)
        for w in view.workers:
            counts[w.state.value] = counts.get(w.state.value, 0) + 1
        workers = GaugeMetricFamily("ps_workers", _WORKERS_HELP, labels=["state"])
        for state, n in counts.items():
            workers.add_metric([state], n)
        yield workers


_VERSION_HELP = "Applied updates on this shard (sync: the round number)."
_WORKERS_HELP = "Worker ranks by membership state as this shard sees them (pending, live, evicted, left)."


class ServerMetrics:
    """The metrics of one shard, registered in ``registry`` (never the global default one).

    Args:
        registry: where every metric is registered; one per process, or one per test.
        status: ``Shard.status``; when given, registers :class:`ShardCollector` over it.
    """

    def __init__(self, registry: CollectorRegistry, status: Callable[[], StatusView] | None = None) -> None:
        self.registry = registry
        self.rpc_duration = Histogram(
            "ps_rpc_duration_seconds",
            "Seconds from the start to the end of an RPC on this shard, by full method name and final status code.",
            ["method", "code"],
            buckets=RPC_SECONDS_BUCKETS,
            registry=registry,
        )
        self.received_bytes = Counter(
            "ps_received_bytes",
            "Serialized bytes of request messages received, by full method name.",
            ["method"],
            registry=registry,
        )
        self.sent_bytes = Counter(
            "ps_sent_bytes",
            "Serialized bytes of response messages sent, by full method name.",
            ["method"],
            registry=registry,
        )
        self.pushes = Counter(
            "ps_pushes",
            "Pushes accepted and applied or held for their round (retried duplicates excluded), by mode.",
            ["mode"],
            registry=registry,
        )
        self.rejected_pushes = Counter(
            "ps_rejected_pushes",
            "Pushes refused, by reason: the status code in snake case, with ABORTED as 'stale'.",
            ["reason"],
            registry=registry,
        )
        self.push_staleness = Histogram(
            "ps_push_staleness",
            "Staleness of accepted pushes: versions (async) or clocks (ssp) behind; always 0 in sync mode.",
            buckets=STALENESS_BUCKETS,
            registry=registry,
        )
        self.barrier_wait = Histogram(
            "ps_barrier_wait_seconds",
            "Seconds a Pull waited for the version it asked for (sync round, ssp bound) before its first "
            "partition was sent.",
            buckets=RPC_SECONDS_BUCKETS,
            registry=registry,
        )
        self.checkpoint_duration = Histogram(
            "ps_checkpoint_duration_seconds",
            "Seconds to write one checkpoint (temp file, fsync, rename); no samples until a checkpoint is written.",
            buckets=CHECKPOINT_SECONDS_BUCKETS,
            registry=registry,
        )
        self.last_checkpoint_version = Gauge(
            "ps_last_checkpoint_version",
            "Version of the newest complete checkpoint of this shard; 0 until a checkpoint is written.",
            registry=registry,
        )
        self.checkpoint_failures = Counter(
            "ps_checkpoint_failures",
            "Checkpoint writes that failed (periodic, Admin/Checkpoint, final), by reason: no_space, permission, "
            "not_a_directory, io_error, other.",
            ["reason"],
            registry=registry,
        )
        for reason in CHECKPOINT_FAILURE_REASONS:
            self.checkpoint_failures.labels(reason)
        if status is not None:
            registry.register(ShardCollector(status))

    def observe_checkpoint(self, version: int, seconds: float) -> None:
        """Record one written checkpoint (for the checkpoint writer)."""
        self.checkpoint_duration.observe(seconds)
        self.last_checkpoint_version.set(version)
