"""Faults with real processes: kill -9 a worker (with and without restart) and a shard (restarted)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

LAUNCH = [
    sys.executable,
    "-m",
    "ps_launch.cli",
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


def launch(tmp_path, *args: str, timeout: float = 240) -> dict:
    """Run ps-launch; a job still running after ``timeout`` s (under pytest's 300 s) fails with what
    each process was doing: every child's thread stacks (``kill -USR1``, written to its log), then
    the tail of the console and of every log."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    console = tmp_path / "console.txt"
    with console.open("w") as err:
        proc = subprocess.Popen(
            [*LAUNCH, "--log-dir", str(tmp_path), *args, "digits"], stdout=subprocess.PIPE, stderr=err, text=True
        )
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        children = re.findall(r"started (\S+) \(pid (\d+)\)", console.read_text())
        asked = []
        for name, pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGUSR1)
                asked.append(tmp_path / f"{name}.log")
        deadline = time.monotonic() + 10  # until each log shows its dump (a process may have gone)
        while time.monotonic() < deadline and not all(
            log.exists() and "most recent call first" in log.read_text(errors="replace") for log in asked
        ):
            time.sleep(0.1)  # polling files other processes write, with a deadline
        proc.terminate()
        proc.communicate(timeout=60)
        logs = "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-6000:]}" for f in sorted(tmp_path.glob("*.*")))
        pytest.fail(f"ps-launch still running after {timeout} s:\n{logs}")
    assert proc.returncode == 0, console.read_text()[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


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
    try:
        s = launch(tmp_path, "--steps", "120", "--fault", "kill-worker:1@step=30,restart")
    except AssertionError as exc:
        # the kill landed after rank 1's push of a round reached shard 0, which closed the round with
        # it, and before it reached shard 1: no process can bring that push now, and the shards
        # cannot close that round alike (docs/faults.md#rounds-atomic-across-shards). Named, never a
        # fork or a hang; any other failure fails the test.
        lost = "cannot close round" in str(exc) and "the process that made it is gone" in str(exc)
        if not lost:
            raise
        pytest.xfail("rank 1 was killed between its push to shard 0 and to shard 1: the named lost round")
    view = s["shards_view"]
    assert s["restarted"] == ["worker-1"]
    assert view["clocks"] == [120, 120] and view["worker_states"] == ["left", "left"]
    assert len(s["params_sha256_per_rank"]) == 2  # both ranks finished and reported
    # rounds are atomic across shards: both ranks end on one model
    assert len(set(s["params_sha256_per_rank"])) == 1, s["params_sha256_per_rank"]


@pytest.mark.slow
def test_watch_recovery_demo_shows_the_restarted_rank_training(tmp_path) -> None:
    """README's "Watch recovery happen": the console shows the kill, the eviction
    and the rejoin, the restarted rank trains to the end, and the summary counts what each rank did.
    Rank 0 is slowed (50 ms a step) so that it is still training when the new process of rank 1, which
    imports torch on a loaded machine, rejoins."""
    out = subprocess.run(
        [*LAUNCH, "--log-dir", str(tmp_path), "--steps", "600", "--slow-rank", "0", "--slow-ms", "50"]
        + ["--fault", "kill-worker:1@step=40,restart", "digits"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    s = json.loads(out.stdout.strip().splitlines()[-1])
    console = out.stderr
    for line in ("worker-1 killed at step", "shard-0 evicted rank 1", "worker-1 rejoined; resumes at step"):
        assert line in console, console[-3000:]
    assert console.index("killed at step") < console.index("evicted rank 1") < console.index("resumes at step")
    rank1 = s["ranks"][1]
    assert rank1["restarts"] == 1 and rank1["finished"]
    resumed = rank1["resumed_at"][0]
    assert resumed < 600 - 50, f"rank 1 resumed at {resumed}: it hardly trained after its restart"
    assert rank1["steps_run"] >= 40 + (600 - resumed) - 5  # before the kill (events lag a few steps) + after
    assert s["ranks"][0]["steps_run"] == 600 and s["steps_run_per_rank"] == [600, rank1["steps_run"]]
    assert s["shards_view"]["clocks"] == [600, 600] and s["version"] == 600
    assert s["samples_per_second"] == pytest.approx(s["steps_per_second"] * 32)
    assert s["final_loss"] is not None and s["pushed_bytes"] > 0
    assert "steps run per rank" in out.stdout and "rank 1 restarted 1x" in out.stdout


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
