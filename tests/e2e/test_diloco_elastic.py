"""diloco through ps-launch when ranks come and go: a resize at an outer round (2 -> 3 -> 1 workers,
also with Streaming DiLoCo's fragments) and a worker killed mid-round and restarted. Both keep the
outer rounds one per H inner steps (H/F with fragments) on every shard and end with every remaining
rank holding theta_global."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.e2e import test_elastic as elastic
from tests.e2e.test_launch import assert_all_gone

H = 10
JOB = [
    *(sys.executable, "-m", "ps_launch.cli", "--shards", "2", "--mode", "diloco", "--communication-period", str(H)),
    *("--lease-timeout", "3", "--no-progress", "--no-metrics", "--json"),
]


def launch(log_dir: Path, workers: int, steps: int, *extra: str) -> tuple[dict, str]:
    return elastic.launch(log_dir, workers, steps, *extra, job=JOB)


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_diloco_job_grows_and_shrinks_at_outer_rounds(tmp_path, fragments: int) -> None:
    steps = 120  # 12 outer rounds of H = 10 inner steps; Streaming DiLoCo (F = 2): 24 of H/F = 5
    every = H // fragments  # inner steps between outer rounds (one fragment a round)
    # rank 0 paces every round (30 ms an inner step), so the resizes land near the steps they name
    summary, stderr = launch(
        tmp_path, 2, steps, "--resize", "3@step=30;1@step=70", "--slow-rank", "0", "--slow-ms", "30",
        "--fragments", str(fragments),
    )  # fmt: skip
    resizes = [f for f in summary["faults"] if "resize" in f]
    assert [r["resize"] for r in resizes] == [3, 1], summary["faults"]
    grow_at, shrink_at = (r["at_version"] for r in resizes)  # outer rounds
    assert 30 // every < grow_at < shrink_at and shrink_at > 70 // every
    assert summary["num_workers_at_end"] == 1 and summary["shards_view"]["versions"] == [steps // every] * 2
    # ranks 1 and 2 pushed their last outer round before the shrink's and stopped at its first inner step
    assert summary["resized_out_at_per_rank"] == [None, shrink_at * every, shrink_at * every], summary[
        "resized_out_at_per_rank"
    ]
    first = {row["rank"]: row["first_step"] for row in summary["ranks"]}
    # rank 2 starts from theta_global (every fragment) at an outer round's first inner step
    assert first[0] == first[1] == 0 and first[2] >= grow_at * every and first[2] % every == 0
    assert summary["accuracy_per_rank"][0] >= 0.7, summary["accuracy_per_rank"]  # it trained (120 steps: 0.9 here)
    assert_all_gone(stderr, expected=5)


def test_a_diloco_worker_killed_mid_round_rejoins_and_the_job_finishes(tmp_path) -> None:
    """Rank 1 is killed inside an outer round: the shards evict it (lease 3 s) and the rounds go on
    with rank 0 alone; its new process rejoins and resumes at the start of an outer round from
    theta_global. Rank 0 is slowed (60 ms an inner step) so that it still trains when rank 1 is back."""
    steps = 400
    summary, stderr = launch(
        tmp_path, 2, steps, "--slow-rank", "0", "--slow-ms", "60", "--fault", "kill-worker:1@step=20,restart"
    )
    assert summary["restarted"] == ["worker-1"], summary
    for line in ("worker-1 killed at step", "shard-0 evicted rank 1", "worker-1 rejoined; resumes at step"):
        assert line in stderr, stderr[-3000:]
    rank1 = summary["ranks"][1]
    assert rank1["restarts"] == 1 and rank1["finished"], rank1
    resumed = rank1["resumed_at"][0]
    assert resumed % H == 0 and resumed < steps, resumed  # an outer round's first inner step
    assert summary["shards_view"]["versions"] == [steps // H] * 2 and summary["ranks"][0]["steps_run"] == steps
    assert min(summary["accuracy_per_rank"]) >= 0.85, summary["accuracy_per_rank"]
    assert_all_gone(stderr, expected=5)  # worker-1 twice
