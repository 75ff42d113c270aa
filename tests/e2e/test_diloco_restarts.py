"""diloco through ps-launch when a process is killed (SIGKILL) and restarted: a worker after a live
change of H, a shard with no checkpoint. Every outer round is applied once on every shard and both
ranks end on one model (issue 43).

Before the fix, the worker restarted after ``ps-admin set --communication-period`` resumed at
version x today's H (rounds before the change count 10 inner steps, not 4): it trained outer rounds
alone after rank 0 had finished and the two ranks exited 0 on different models; the shard that came
back empty was written rank 0's local, mid-round parameters at version 0 and redid rounds the other
shard refused, so the job ended at version 20 of the 30 outer rounds it ran.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.e2e import test_diloco_elastic as diloco
from tests.e2e.test_launch import assert_all_gone

H, NEW_H, AT = 10, 4, 4
"""The job's H, and the live change: H = 4 from outer round 4 (inner step 40) on."""


def test_a_worker_killed_after_a_live_change_of_h_resumes_at_the_clusters_inner_step(tmp_path: Path) -> None:
    """ps-admin sets H 10 -> 4 from round 4 while the workers start; rank 1 is killed at step 60
    (round 9) and restarted. It resumes at the first inner step of a round counted with each
    round's own H (40 + 4 k), and both ranks end at version 4 + (300 - 40) / 4 = 69 on one model."""
    steps = 300
    argv = [*diloco.JOB, "--workers", "2", "--steps", str(steps), "--log-dir", str(tmp_path)]
    argv += ["--slow-rank", "0", "--slow-ms", "50", "--fault", "kill-worker:1@step=60,restart", "digits"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    shards = threading.Event()
    servers: list[str] = []

    def drain() -> None:  # ps-launch's stderr, read as it comes: its shard addresses first
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            found = re.search(r"2 shards on (\S+), (\S+);", line)
            if found:
                servers.extend(found.groups())
                shards.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        assert shards.wait(60), "".join(lines)[-3000:]
        admin = [sys.executable, "-m", "ps_admin.cli", "--servers", ",".join(servers), "--timeout", "20"]
        setting = [*admin, "set", "--communication-period", str(NEW_H), "--at-version", str(AT)]
        done = subprocess.run(setting, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr  # the workers are still importing torch: shard 0 is at version 0
        # stdout in a thread of its own: communicate() would also read stderr, racing the drain thread
        outs: list[str] = []
        writer = threading.Thread(target=lambda: outs.append(proc.stdout.read() if proc.stdout else ""), daemon=True)
        writer.start()
        proc.wait(timeout=240)
        writer.join(timeout=30)
        out = "".join(outs)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    reader.join(timeout=30)
    stderr = "".join(lines)
    assert proc.returncode == 0, stderr[-4000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["restarted"] == ["worker-1"], summary
    resumed = summary["ranks"][1]["resumed_at"][0]
    assert resumed >= AT * H and (resumed - AT * H) % NEW_H == 0, resumed  # a round's first inner step
    final = AT + (steps - AT * H) // NEW_H
    assert summary["shards_view"]["versions"] == [final, final], summary["shards_view"]
    shas = summary["params_sha256_per_rank"]
    assert len(set(shas)) == 1 and None not in shas, shas  # one model on every rank
    assert_all_gone(stderr, expected=5)  # worker-1 twice


def test_a_shard_killed_without_checkpoints_loses_no_outer_round(tmp_path: Path) -> None:
    """Shard 1 (no checkpoint: the default) is killed at step 75 and comes back empty: rank 0 writes
    it theta_global at the outer round the ranks are in, they push that round to it again, and the
    job ends at version steps / H on both shards, every rank on one model."""
    steps = 200
    start = time.monotonic()
    summary, stderr = diloco.launch(
        tmp_path, 2, steps, "--slow-rank", "0", "--slow-ms", "20", "--fault", "kill-shard:1@step=75,restart"
    )
    assert summary["faults"][0]["fault"] == "kill-shard:1@step=75,restart", summary["faults"]
    assert summary["shards_view"]["versions"] == [steps // H] * 2, summary["shards_view"]
    assert summary["shards_view"]["restored_from"] == [None, None]  # it came back empty
    shas = summary["params_sha256_per_rank"]
    assert len(set(shas)) == 1 and None not in shas, shas
    shard_log = (tmp_path / "shard-1.log").read_text()
    at = [int(v) for v in re.findall(r"initialized with .* at version (\d+)", shard_log)]
    assert at[0] == 0 and len(at) == 2 and 0 < at[1] < steps // H, at  # the second Init: the ranks' round
    assert "gradient is dropped" not in stderr + "".join(p.read_text() for p in tmp_path.glob("worker-*.log"))
    assert_all_gone(stderr, expected=5)  # shard-1 twice
    assert time.monotonic() - start < 120
