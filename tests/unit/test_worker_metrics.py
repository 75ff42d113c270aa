"""ps_worker.metrics: a worker's metric names (docs/architecture.md#10-commands-and-metrics), in an injected
registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from ps_worker.metrics import WorkerMetrics


def test_push_push_pull_and_pull_are_separate_histograms() -> None:
    registry = CollectorRegistry()
    m = WorkerMetrics(registry)
    m.push_pull_duration.observe(0.02)
    m.push_duration.observe(0.01)
    names = {metric.name for metric in registry.collect()}
    assert {
        "ps_worker_step_duration_seconds",
        "ps_worker_push_duration_seconds",
        "ps_worker_push_pull_duration_seconds",
        "ps_worker_pull_duration_seconds",
        "ps_worker_sent_bytes",
        "ps_worker_received_bytes",
        "ps_worker_loss",
        "ps_worker_local_steps",
        "ps_worker_outer_rounds",
        "ps_worker_outer_round_bytes",
    } <= names
    assert registry.get_sample_value("ps_worker_push_pull_duration_seconds_count") == 1
    assert registry.get_sample_value("ps_worker_push_duration_seconds_sum") == 0.01
    assert registry.get_sample_value("ps_worker_pull_duration_seconds_count") == 0
