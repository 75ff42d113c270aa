"""Prometheus metrics of a worker (docs/architecture.md#10-commands-and-metrics), built against an injected registry.

:class:`~ps_worker.client.PSClient` records push, pull and push-pull (step) times and bytes when given a
:class:`WorkerMetrics`; :func:`~ps_worker.workloads.train.train` records step times and the loss. Without
one (the default) nothing is recorded and no global state is touched.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
"""Seconds; a push or pull moves every parameter and a sync pull waits for its round."""

BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(13))
"""Bytes, 1 KiB to 16 GiB by factors of 4: a model's push and pull, from a toy to a large model."""


class WorkerMetrics:
    """The metrics of one worker process, registered in ``registry``.

    Args:
        registry: where every metric is registered; one per process, or one per test.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.step_duration = Histogram(
            "ps_worker_step_duration_seconds",
            "Seconds of one training step: batch, forward, backward, push and pull.",
            buckets=STEP_SECONDS_BUCKETS,
            registry=registry,
        )
        self.push_duration = Histogram(
            "ps_worker_push_duration_seconds",
            "Seconds of one separate push of every gradient to every shard (in parallel), retries included; "
            "the push alone, never a pull.",
            buckets=STEP_SECONDS_BUCKETS,
            registry=registry,
        )
        self.push_pull_duration = Histogram(
            "ps_worker_push_pull_duration_seconds",
            "Seconds a training step waits on the shards: one PushPull (push and the pull of its round) or "
            "one EASGD exchange with every shard, retries included.",
            buckets=STEP_SECONDS_BUCKETS,
            registry=registry,
        )
        self.pull_duration = Histogram(
            "ps_worker_pull_duration_seconds",
            "Seconds of one pull of every parameter from every shard, the wait for the version included.",
            buckets=STEP_SECONDS_BUCKETS,
            registry=registry,
        )
        self.sent_bytes = Counter(
            "ps_worker_sent_bytes",
            "Serialized bytes of Init and Push messages sent to the shards, retries included.",
            registry=registry,
        )
        self.received_bytes = Counter(
            "ps_worker_received_bytes",
            "Serialized bytes of Pull messages received from the shards.",
            registry=registry,
        )
        self.local_steps = Counter(
            "ps_worker_local_steps",
            "easgd and diloco: steps of this rank's local (inner) optimizer.",
            registry=registry,
        )
        self.outer_rounds = Counter(
            "ps_worker_outer_rounds",
            "diloco: outer rounds this rank took part in (a push of its outer gradient and a pull of the result).",
            registry=registry,
        )
        self.outer_round_bytes = Histogram(
            "ps_worker_outer_round_bytes",
            "diloco: serialized bytes one outer round sent and received (its push and its pull, every shard).",
            buckets=BYTES_BUCKETS,
            registry=registry,
        )
        self.loss = Gauge(
            "ps_worker_loss",
            "Training loss of the latest step on this worker (NaN before the first step).",
            registry=registry,
        )
        self.loss.set(float("nan"))
