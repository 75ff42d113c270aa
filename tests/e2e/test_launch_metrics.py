"""``ps-launch`` gives every shard and worker a /metrics port and reports the URLs."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_launch_reports_every_metrics_url(tmp_path) -> None:
    argv = [sys.executable, "-m", "ps_launch.cli", "--shards", "2", "--workers", "1", "--steps", "3"]
    result = subprocess.run(
        [*argv, "--no-progress", "--json", "--log-dir", str(tmp_path), "digits"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    urls = summary["metrics_urls"]
    assert sorted(urls) == ["shard-0", "shard-1", "worker-0"]
    assert all(re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", u) for u in urls.values())
    assert len(set(urls.values())) == 3
    for name, url in urls.items():
        assert f"ps-launch: {name} metrics on {url}" in result.stderr
