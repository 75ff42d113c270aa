"""``ps-launch --save`` and ``--init-from``: the finished job's model written before the shards stop,
a job started from such a file, and bad paths refused before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from ps_launch.save import save_model
from ps_worker.workloads.digits import DigitsWorkload

LAUNCH = [sys.executable, "-m", "ps_launch.cli"]


def test_a_job_started_from_a_file_saves_its_final_model_before_the_shards_stop(tmp_path) -> None:
    """lr 0: the job's final model is the file it started from, bitwise (--init-from reached the
    shards through rank 0's Init; --save read them back after the workers finished)."""
    torch.manual_seed(5)
    start = {k: v.contiguous() for k, v in DigitsWorkload().model().state_dict().items()}
    save_file(start, tmp_path / "start.safetensors")
    flags = ["--shards", "2", "--workers", "1", "--steps", "2", "--lr", "0", "--momentum", "0", "--no-metrics"]
    out = subprocess.run(
        [*LAUNCH, *flags, "--no-progress", "--json", "--init-from", str(tmp_path / "start.safetensors")]
        + ["--log-dir", str(tmp_path / "logs"), "digits"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    saved = tmp_path / "logs" / "model.safetensors"  # the default with --log-dir
    assert f"model saved         {saved}: 4 tensors" in out.stdout
    assert json.loads(out.stdout.strip().splitlines()[-1])["saved"].startswith(str(saved))
    final = load_file(saved)
    assert sorted(final) == sorted(start) and all(torch.equal(final[k], start[k]) for k in start)
    torch.manual_seed(0)  # what the job would have started from without --init-from
    assert not torch.equal(DigitsWorkload().model().state_dict()["0.weight"], final["0.weight"])


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--save", "model.bin"], "suffix '.bin'"),
        (["--save", "/nonexistent-dir/model.pt"], "does not exist"),
        (["--init-from", "/nonexistent-dir/model.pt"], "no such file"),
    ],
)
def test_bad_save_and_init_paths_are_refused_before_starting_anything(tmp_path, flags, says) -> None:
    out = subprocess.run([*LAUNCH, *flags, "digits"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and says in out.stderr and "started" not in out.stderr, out.stderr


def test_a_save_that_fails_says_so() -> None:
    with pytest.raises(RuntimeError, match="--save .*model.pt: the model was not saved: .*UNAVAILABLE"):
        save_model(("/tmp/model.pt", "pt"), ["127.0.0.1:1"], within=1.0)
