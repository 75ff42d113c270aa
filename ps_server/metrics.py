"""Prometheus metrics of a shard (docs/architecture.md#10-commands-and-metrics), built against an injected registry.

Every name here is contract. RPC durations and barrier waits are recorded by
:class:`ps_server.service.call_metrics.CallMetrics`; pushes, refused pushes, push staleness and bytes
are read at scrape time from the shard's :class:`~ps_server.shard.counters.ShardCounters` (the numbers
Admin/GetStatus reports) by :class:`CountersCollector`; the gauges that mirror shard state
(``ps_model_version``, ``ps_workers``) are read from ``Shard.status()`` at scrape time by
:class:`ShardCollector`, so there is no second copy of any of it to drift.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ps_server.shard.counters import CountersView, ShardCounters

if TYPE_CHECKING:
    from ps_server.shard.shard import StatusView

log = logging.getLogger(__name__)

RPC_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
"""Seconds; up to 60 s because a sync Pull may wait a whole round (the worker's default deadline)."""

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)
"""Upper bounds of the ``ps_push_staleness`` buckets, in versions behind (async and ssp alike)."""

CHECKPOINT_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

CHECKPOINT_FAILURE_REASONS = ("no_space", "permission", "not_a_directory", "io_error", "other")
"""Values of the ``reason`` label of ``ps_checkpoint_failures_total`` (``checkpoint.failure_reason``);
every one is exported from the start, zeros included, so a first failure shows in ``increase()``."""

REFUSAL_REASONS = (
    "stale",
    "late",
    "replayed",
    "non_finite_update",
    "update_failed",
    "hyperparameters_disagree",
    "round_timeout",
    "join_timeout",
    "lost_round",
)
"""The shard's own values of the ``reason`` label of ``ps_rejected_pushes_total``: every one is exported from
the start, zeros included, so a dashboard shows them and a first refusal shows in ``increase()``; the status-code
reasons (``invalid_argument``, ...) appear at their first refusal. GetStatus reports only the non-zero ones."""

WORKER_STATES = ("pending", "live", "evicted", "left")
"""Values of the ``state`` label of ``ps_workers``; every one is exported, zeros included."""


class ShardCollector(Collector):
    """``ps_model_version`` and ``ps_workers{state}``, read from one status snapshot per scrape.

    Args:
        status: returns the shard's current :class:`~ps_server.shard.shard.StatusView` (``Shard.status``).
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


STALENESS_HELP = (
    "Staleness of accepted pushes in versions behind: the shard's version minus the version the gradient was "
    "computed on (async and ssp alike; ssp's bound s counts clocks, see GetStatus max_clock_gap); always 0 in "
    "sync mode."
)


def _buckets(counts: dict[int, int], bounds: Iterable[float]) -> list[tuple[str, float]]:
    """Cumulative (le, count) buckets of a histogram of integers, ``+Inf`` last."""
    out = [(str(float(b)), float(sum(n for v, n in counts.items() if v <= b))) for b in bounds]
    return [*out, ("+Inf", float(sum(counts.values())))]


STREAM_OUTCOMES = ("streamed", "put_back")
"""The ``outcome`` label values of ``ps_streamed_rounds_total``."""


class CountersCollector(Collector):
    """Prometheus view of :class:`ShardCounters` (metric names and help text are contract)."""

    def __init__(self, counters: ShardCounters) -> None:
        self._counters = counters

    def describe(self) -> list[CounterMetricFamily | HistogramMetricFamily]:
        return list(self._families(None))

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        yield from self._families(self._counters.view())

    @staticmethod
    def _families(view: CountersView | None) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        labelled = (
            ("ps_received_bytes", "Serialized bytes of request messages received, by full method name.", "method"),
            ("ps_sent_bytes", "Serialized bytes of response messages sent, by full method name.", "method"),
            (
                "ps_pushes",
                "Pushes accepted and applied or held for their round (retried duplicates excluded), by mode.",
                "mode",
            ),
            (
                "ps_rejected_pushes",
                "Pushes refused or dropped, by reason: the shard's own (stale, replayed, late, non_finite_update, "
                "update_failed, hyperparameters_disagree, round_timeout, join_timeout), else the status code in "
                "snake case, with ABORTED as 'stale'.",
                "reason",
            ),
        )
        refused = dict.fromkeys(REFUSAL_REASONS, 0) | (view.rejected_pushes if view else {})
        values = (view.received_bytes, view.sent_bytes, view.pushes, refused) if view else ({}, {}, {}, refused)
        for (name, text, label), counts in zip(labelled, values, strict=True):
            family = CounterMetricFamily(name, text, labels=[label])
            for key, n in sorted(counts.items()):
                family.add_metric([key], n)
            yield family
        streamed = CounterMetricFamily(
            "ps_streamed_rounds",
            "Sync rounds stepped partition by partition as their pushes arrived (--stream-rounds), by outcome: "
            "streamed (the round closed as streamed), put_back (the stream ended first: every stepped partition "
            "was put back and the round applied at its close).",
            labels=["outcome"],
        )
        for outcome in STREAM_OUTCOMES:
            streamed.add_metric([outcome], (view.streamed_rounds if view else {}).get(outcome, 0))
        yield streamed
        staleness = view.staleness if view else {}
        yield HistogramMetricFamily(
            "ps_push_staleness",
            STALENESS_HELP,
            buckets=_buckets(staleness, STALENESS_BUCKETS),
            sum_value=float(sum(v * n for v, n in staleness.items())),
        )


class ServerMetrics:
    """The metrics of one shard, registered in ``registry`` (never the global default one).

    Args:
        registry: where every metric is registered; one per process, or one per test.
        status: ``Shard.status``; when given, registers :class:`ShardCollector` over it.
        counters: the shard's counters (``Shard.counters``), exported by :class:`CountersCollector`;
            fresh ones by default.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        status: Callable[[], StatusView] | None = None,
        counters: ShardCounters | None = None,
    ) -> None:
        self.registry = registry
        self.counters = counters or ShardCounters()
        registry.register(CountersCollector(self.counters))
        self.rpc_duration = Histogram(
            "ps_rpc_duration_seconds",
            "Seconds from the start to the end of an RPC on this shard, by full method name and final status code.",
            ["method", "code"],
            buckets=RPC_SECONDS_BUCKETS,
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
        self.last_checkpoint_timestamp = Gauge(
            "ps_last_checkpoint_timestamp_seconds",
            "Unix time in seconds when the newest complete checkpoint of this shard was written (after a restart: "
            "the modification time of the checkpoint it resumed from); 0 until a checkpoint is written.",
            registry=registry,
        )
        for reason in CHECKPOINT_FAILURE_REASONS:
            self.checkpoint_failures.labels(reason)
        if status is not None:
            registry.register(ShardCollector(status))

    def observe_checkpoint(self, version: int, seconds: float) -> None:
        """Record one written checkpoint (for the checkpoint writer): ``version`` is the newest on disk, written now."""
        self.checkpoint_duration.observe(seconds)
        self.last_checkpoint_version.set(version)
        self.last_checkpoint_timestamp.set_to_current_time()

    def observe_resume(self, version: int, written_at: float | None) -> None:
        """Record the checkpoint a restarted shard resumed from: its ``version`` and the Unix time in seconds
        its file was written (None when unknown: the timestamp stays as it is)."""
        self.last_checkpoint_version.set(version)
        if written_at is not None:
            self.last_checkpoint_timestamp.set(written_at)
