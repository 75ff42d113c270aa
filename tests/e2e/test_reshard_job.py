"""A job run by ``ps-launch --log-dir DIR`` on 2 shards, stopped, resharded in place with
``ps-admin reshard --from DIR/checkpoints --to 3``, then resumed by ``ps-launch --shards 3 --log-dir
DIR``: every rank starts at the stopped job's clock and the job finishes on 3 shards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.e2e.test_launch import assert_all_gone

STEPS = 12
JOB = [
    *(sys.executable, "-m", "ps_launch.cli", "--workers", "2", "--mode", "sync", "--checkpoint-every", "4"),
    *("--batch-size", "16", "--no-progress", "--no-metrics", "--json"),
]


def launch(log_dir: Path, shards: int, steps: int) -> tuple[dict, str]:
    out = subprocess.run(
        [*JOB, "--shards", str(shards), "--steps", str(steps), "--log-dir", str(log_dir), "digits"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_a_job_stopped_on_2_shards_resumes_on_3_after_ps_admin_reshard(tmp_path) -> None:
    summary, _ = launch(tmp_path, 2, STEPS)
    assert summary["shards_view"]["versions"] == [STEPS] * 2
    checkpoints = tmp_path / "checkpoints"
    reshard = [sys.executable, "-m", "ps_admin.cli", "reshard", "--from", str(checkpoints)]
    done = subprocess.run([*reshard, "--to", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"resharded version {STEPS} of 2 shards" in done.stdout
    assert sorted(p.name for p in checkpoints.glob("shard-*.pt")) == [f"shard-{k}-v{STEPS:012d}.pt" for k in range(3)]
    assert len(list((checkpoints / f"before-reshard-v{STEPS}-2-shards").glob("shard-*.pt"))) == 6  # kept

    summary, stderr = launch(tmp_path, 3, STEPS + 8)
    view = summary["shards_view"]
    assert view["versions"] == [STEPS + 8] * 3 and view["restored_from"] == [STEPS] * 3
    assert [row["first_step"] for row in summary["ranks"]] == [STEPS] * 2
    assert len(set(summary["params_sha256_per_rank"])) == 1  # sync: every rank ends with the same model
    assert_all_gone(stderr, expected=5)
