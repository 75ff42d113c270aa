"""ps_worker.workloads.flags: the light flag module agrees with the workloads it names (no sockets)."""

from __future__ import annotations

from ps_worker.workloads.flags import WORKLOAD_NAMES, worker_parser
from ps_worker.workloads.registry import WORKLOADS


def test_workload_names_are_the_workloads() -> None:
    assert WORKLOAD_NAMES == tuple(sorted(WORKLOADS))


def test_worker_metrics_default_is_a_free_port() -> None:
    args = worker_parser({}).parse_args(["--servers", "h:1", "--rank", "0", "--num-workers", "1"])
    assert args.metrics_port == 0 and not args.json and not args.no_progress
