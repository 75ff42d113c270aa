"""Faults with real processes: kill -9 a worker (with and without restart) and a shard (restarted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

LAUNCH = [
    sys.executable,
    "-m",
    "ps_worker.launch",
    "--shards",
    "2",
    "--workers",
    "2",
    "--lease-timeout",
    "2",
    "--json",
    "--no-progress",
    "--no-metrics",
]


def launch(tmp_path, *args: str) -> dict:
    out = subprocess.run(
        [*LAUNCH, "--log-dir", str(tmp_path), *args, "digits"], capture_output=True, text=True, timeout=400
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_killed_worker_is_evicted_and_the_other_finishes(tmp_path) -> None:
    s = launch(tmp_path, "--steps", "120", "--fault", "kill-worker:1@step=30")
    view = s["shards_view"]
    assert [f["fault"] for f in s["faults"]] == ["kill-worker:1@step=30"]
    assert view["worker_states"] == ["left", "evicted"]
    assert view["clocks"][0] == 120 and view["clocks"][1] < 120
    assert s["version"] == 120  # the rounds went on without the dead rank


@pytest.mark.slow
def test_restarted_worker_rejoins_and_is_counted(tmp_path) -> None:
    s = launch(tmp_path, "--steps", "120", "--fault", "kill-worker:1@step=30,restart")
    view = s["shards_view"]
    assert s["restarted"] == ["worker-1"]
    assert view["clocks"] == [120, 120] and view["worker_states"] == ["left", "left"]
    assert len(s["params_sha256_per_rank"]) == 2  # both ranks finished and reported
    # Not asserted: equal final parameters across ranks. Each shard evicts the dead rank on its own
    # lease clock, so one shard may close a round alone that the other does not, and a rank can end
    # one round newer on one shard (README, "Known limitation"; fault-free runs are bitwise equal,
    # tests/e2e/test_launch.py).


@pytest.mark.slow
def test_killed_shard_restarts_and_training_completes(tmp_path) -> None:
    # the default 10 s lease: this test is about a shard's restart, not about evictions
    clean = launch(tmp_path / "clean", "--steps", "300", "--lease-timeout", "10")
    faulty = launch(
        tmp_path / "faulty", "--steps", "300", "--lease-timeout", "10", "--fault", "kill-shard:0@step=100,restart"
    )
    assert [f["fault"] for f in faulty["faults"]] == ["kill-shard:0@step=100,restart"]
    assert faulty["shards_view"]["restored_from"][0] is not None  # resumed from a checkpoint, not from scratch
    assert faulty["shards_view"]["restored_from"][1] is None
    assert faulty["accuracy"] >= clean["accuracy"] - 0.02, (clean["accuracy"], faulty["accuracy"])


def test_bad_fault_spec_is_refused_before_starting(tmp_path) -> None:
    out = subprocess.run(
        [*LAUNCH, "--fault", "kill-worker:5@step=1", "digits"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "only 2 workers" in out.stderr
