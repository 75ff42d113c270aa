"""ps-launch trains charlm as a user runs it: the held-out loss falls below an untrained model's."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from ps_launch.cli import launch_parser
from tests.e2e.test_launch import LAUNCH, assert_all_gone


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_charlm_sixty_adamw_steps_beat_an_untrained_model(tmp_path) -> None:
    out = subprocess.run(
        [
            *LAUNCH,
            "--shards",
            "2",
            "--workers",
            "2",
            "--steps",
            "60",
            "--batch-size",
            "8",
            "--optimizer",
            "adamw",
            "--lr",
            "3e-3",
            "--json",
            "--no-progress",
            "--no-metrics",
            "--log-dir",
            str(tmp_path),
            "charlm",
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["workload"] == "charlm" and summary["version"] == 60
    assert summary["eval_loss"] < math.log(256) - 1.0, summary  # untrained: log(256) = 5.55 nats/char
    assert summary["accuracy"] > 1 / 256
    assert "held-out loss" in out.stdout
    # the bits per char the README promises: loss in nats / ln 2
    assert summary["bits_per_char"] == pytest.approx(summary["eval_loss"] / math.log(2))
    assert f"bits per char       {summary['bits_per_char']:.3f} (held out)" in out.stdout
    assert_all_gone(out.stderr, expected=4)


def test_corpus_is_a_flag_with_a_twin_and_refused_for_digits(tmp_path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("x")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ps_worker.workloads.cli",
            "--servers",
            "127.0.0.1:1",
            "--rank",
            "0",
            "--num-workers",
            "1",
        ]
        + ["--corpus", str(corpus), "digits"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--corpus applies to charlm only" in out.stderr
    assert launch_parser({"PS_CORPUS": str(corpus)}).parse_args(["charlm"]).corpus == str(corpus)
