"""A shard of an embedding-table job (ctr) ``kill -9``ed a few rounds after a periodic checkpoint and
restarted by ps-launch: the ranks push it the dense rounds and the table rounds it lost again, from
their redo logs, and the job ends bitwise where the same job without the fault ends.

Before the table rounds were logged, the same fault ended the job at once: a PullRows of a table
version the restarted shard could no longer make (``OUT_OF_RANGE``), or with ``--durable-acks`` a
PushRows refused ``NOT_JOINED`` and never joined again.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_launch import LAUNCH

STEPS = 80


def launch(log_dir: Path, *extra: str) -> tuple[dict, str]:
    out = subprocess.run(
        [
            *LAUNCH,
            *("--shards", "2", "--workers", "2", "--steps", str(STEPS), "--checkpoint-every", "20"),
            *("--json", "--no-progress", "--no-metrics", "--log-dir", str(log_dir), *extra, "ctr"),
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    logs = "".join(p.read_text(errors="replace") for p in log_dir.glob("worker-*.log"))
    return json.loads(out.stdout.strip().splitlines()[-1]), logs


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_a_table_shard_restarted_from_an_older_checkpoint_gets_its_lost_rounds_pushed_again(tmp_path: Path) -> None:
    reference, _ = launch(tmp_path / "reference")
    faulted, logs = launch(tmp_path / "kill", "--fault", "kill-shard:1@step=47,restart")
    # the fault hit after the checkpoint at version 40 (its tables' version then: 39 or 40)
    assert re.search(r"lost table rounds (39|40)\.\.", logs), logs[-2000:]
    assert faulted["version"] == reference["version"] == STEPS
    assert faulted["params_sha256_per_rank"] == reference["params_sha256_per_rank"]
    assert len(set(faulted["params_sha256_per_rank"])) == 1
