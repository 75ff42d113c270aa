"""``bench/sparse_rows.py`` on a small table: real ps-server and
worker processes, 2 workers x 2 shards in sync mode; the bytes on the shards' counters per step are
within 10 % of distinct ids x dim x 4 x 2, and no process comes near holding the table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_bytes_per_step_are_proportional_to_rows_touched() -> None:
    rows, dim = 1_000_000, 64
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sparse_rows.py"), f"--rows={rows}", f"--dim={dim}", "--steps=5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert 1.0 <= report["ratio"] <= 1.10, report
    assert report["table_bytes"] == rows * dim * 4
    assert all(0 < rss for rss in report["shard_peak_rss"] + report["worker_peak_rss"])
