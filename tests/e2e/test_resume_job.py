"""Whole-job resume: ``ps-launch --log-dir DIR`` killed with SIGKILL everywhere mid-run (shards, workers,
the launcher), then run again with the same command, ends where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from tests.e2e.test_launch import alive, assert_all_gone, pids

STEPS = 200
EVERY = 20
JOB = [
    *(sys.executable, "-m", "ps_launch.cli", "--shards", "2", "--workers", "2", "--mode", "sync"),
    # a restored shard gives the ranks it saved as live one lease to rejoin (ps_server.membership.ranks
    # Membership.restore): long enough for a worker process to start on a loaded 2-core machine
    *("--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--lease-timeout", "30"),
    *("--no-progress", "--no-metrics", "--json"),
]


def finish(log_dir: Path, *extra: str) -> dict:
    out = subprocess.run(
        [*JOB, "--log-dir", str(log_dir), *extra, "digits"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert_all_gone(out.stderr, expected=4)
    return json.loads(out.stdout.strip().splitlines()[-1])


def status(address: str) -> ps_pb2.ShardStatus:
    with grpc.insecure_channel(address) as channel:
        return ps_pb2_grpc.AdminStub(channel).GetStatus(ps_pb2.GetStatusRequest(), timeout=2.0).status


def kill_mid_run(log_dir: Path) -> int:
    """Start the job (rank 1 a straggler, so the run lasts seconds: sync results do not depend on it),
    and SIGKILL every process once both shards have the same checkpoint and are half-way to the next.
    Returns the version the shards had checkpointed."""
    proc = subprocess.Popen(
        [*JOB, "--log-dir", str(log_dir), "--slow-rank", "1", "--slow-ms", "40", "digits"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
    deadline = time.monotonic() + 240
    checkpointed = None
    try:
        while checkpointed is None:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)[-3000:]
            shards = re.search(r"2 shards on (\S+), (\S+);", "".join(lines))
            if not shards or len(pids("".join(lines))) < 4:
                time.sleep(0.05)  # polling the launcher's output, with the deadline above
                continue
            try:
                views = [status(a) for a in shards.groups()]
            except grpc.RpcError:
                continue
            ckpt = {v.last_checkpoint_version if v.HasField("last_checkpoint_version") else -1 for v in views}
            version = min(v.version for v in views)
            if len(ckpt) == 1 and (c := ckpt.pop()) >= 3 * EVERY and 5 <= version - c <= EVERY - 5:
                checkpointed = c
            assert version < STEPS - EVERY, "the run got too far to be interrupted mid-run"
        children = pids("".join(lines))
        for pid in children:  # kill -9 of everything: no SIGTERM checkpoint, no goodbye
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=30)
        stop = time.monotonic() + 30
        while any(alive(p) for p in children) and time.monotonic() < stop:
            time.sleep(0.05)
        assert not any(alive(p) for p in children)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    return checkpointed


@pytest.mark.slow
def test_a_job_killed_everywhere_resumes_from_its_checkpoints_and_ends_like_an_uninterrupted_one(tmp_path) -> None:
    whole = finish(tmp_path / "whole")
    checkpointed = kill_mid_run(tmp_path / "job")
    resumed = finish(tmp_path / "job")
    assert resumed["shards_view"]["restored_from"] == [checkpointed, checkpointed]
    # every rank started at the cluster's clock and ran the steps left: --steps counts the whole job
    assert resumed["version"] == whole["version"] == STEPS
    assert resumed["shards_view"]["clocks"] == whole["shards_view"]["clocks"] == [STEPS, STEPS]
    assert resumed["steps_run_per_rank"] == [STEPS - checkpointed] * 2
    assert abs(resumed["accuracy"] - whole["accuracy"]) <= 0.01, (resumed["accuracy"], whole["accuracy"])
    # sync: the same data, in the same order, from the same state: the very same bits
    assert resumed["params_sha256"] == whole["params_sha256"]
