"""ps-launch trains ctr as a user runs it (docs/ctr.md's recipe): 2 shards x 2 sync workers reach the click
log's ground-truth AUC within 0.01, with the embedding tables served as rows."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.e2e.test_launch import LAUNCH, assert_all_gone

MIB = 1024 * 1024


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctr_reaches_the_ground_truth_auc_within_0_01(tmp_path) -> None:
    """About 55 s on a shared 2-core machine (10 s of it generating and evaluating the data)."""
    out = subprocess.run(
        [
            *LAUNCH,
            "--shards",
            "2",
            "--workers",
            "2",
            "--mode",
            "sync",
            "--optimizer",
            "adagrad",
            "--lr",
            "0.05",
            "--batch-size",
            "512",
            "--steps",
            "800",
            "--json",
            "--no-progress",
            "--no-metrics",
            "--log-dir",
            str(tmp_path),
            "ctr",
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["workload"] == "ctr" and summary["version"] == 800
    truth = summary["ground_truth_auc"]
    assert truth == pytest.approx(0.8238, abs=5e-4)  # docs/ctr.md: the default held-out set's
    assert summary["auc"] > truth - 0.01, summary
    assert summary["auc"] <= truth + 0.005  # no model beats the hidden probabilities by more than noise
    assert len(set(summary["params_sha256_per_rank"])) == 1
    # the tables (7.7 MiB) travel as the rows of each batch: 800 steps of whole tables would be 12 GiB
    assert summary["pushed_bytes"] < 100 * MIB and summary["pulled_bytes"] < 100 * MIB, summary
    assert f"held-out AUC        {summary['auc']:.4f} (ground truth {truth:.4f})" in out.stdout
    assert_all_gone(out.stderr, expected=4)
