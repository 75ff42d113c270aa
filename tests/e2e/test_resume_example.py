"""examples/resume_adamw.py through ps-launch, as its docstring runs it: 8 steps straight, or 4 steps,
a checkpoint, and a fresh cluster resuming from it (AdamW, two groups, a LambdaLR), loaded where a
DDP script loads it (the torch optimizer, before the client) or into the DistributedOptimizer: the
resumed runs end on bitwise the weights and optimizer state of the uninterrupted one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.test_ddp_port import clean_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples" / "resume_adamw.py")
LAUNCH = [sys.executable, "-m", "ps_launch.cli", "--shards", "2", "--workers", "2", "--mode", "sync"]
TIMEOUT = 300.0
"""Seconds one ps-launch run may take (torch start-up of 4 processes on a loaded machine included)."""


def launch(tmp_path: Path, name: str, *argv: str) -> str:
    """One job in its own log directory (a shared one would resume the previous job's checkpoints)."""
    cmd = [*LAUNCH, "--no-progress", "--no-metrics", "--log-dir", str(tmp_path / name), SCRIPT, *argv]
    out = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    return out.stdout


@pytest.mark.slow
def test_resume_in_either_order_ends_on_the_uninterrupted_runs_weights(tmp_path: Path) -> None:
    launch(tmp_path, "full", "--steps", "8", "--save", "full.pt")
    launch(tmp_path, "half", "--steps", "4", "--save", "half.pt")
    half = torch.load(tmp_path / "half.pt", weights_only=True)
    assert set(half["optimizer"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}  # the shards' moments
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    for order in ("ddp", "docs"):
        out = launch(tmp_path, order, "--steps", "8", "--resume", "half.pt", "--order", order, "--save", f"{order}.pt")
        assert "rank 0: steps 4..8" in out, out
        resumed = torch.load(tmp_path / f"{order}.pt", weights_only=True)
        for k, v in full["model"].items():
            assert torch.equal(resumed["model"][k], v), f"{order}: {k} differs"
        for i, entry in full["optimizer"]["state"].items():
            for name, v in entry.items():
                assert torch.equal(resumed["optimizer"]["state"][i][name], v), f"{order}: state {i}.{name} differs"
        assert resumed["scheduler"]["last_epoch"] == full["scheduler"]["last_epoch"] == 8
    assert not torch.equal(half["model"]["0.weight"], full["model"]["0.weight"])  # the second half trained
