"""``ps-launch --tensorboard DIR``: one TensorBoard run per rank, read back with TensorBoard's own reader."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers.scripts import load_script

render_watch = load_script("render_watch")
LAUNCH = [sys.executable, "-m", "ps_launch.cli", "--shards", "1", "--no-progress", "--no-metrics"]


def scalars(run_dir) -> dict[str, list[tuple[int, float]]]:  # noqa: ANN001
    """tag -> [(step, value)] of the one event file in ``run_dir``."""
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1, list(run_dir.iterdir())
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_built_in_workload_writes_each_rank_s_curves_and_held_out_scores(tmp_path) -> None:
    tb = tmp_path / "tb"
    argv = ["--workers", "2", "--mode", "async", "--steps", "20", "--json", "--log-dir", str(tmp_path / "logs")]
    out = subprocess.run(
        [*LAUNCH, *argv, "--tensorboard", str(tb), "--tensorboard-every", "5", "digits"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"TensorBoard curves in {tb}/rank-R (view: tensorboard --logdir {tb})" in out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(p.name for p in tb.iterdir()) == ["rank-0", "rank-1"]
    for rank in (0, 1):
        s = scalars(tb / f"rank-{rank}")
        assert [step for step, _ in s["train/loss"]] == [1, 5, 10, 15, 20]
        assert s["train/loss"][-1][1] < s["train/loss"][0][1]  # it learns
        assert [step for step, _ in s["train/staleness"]] == [1, 5, 10, 15, 20]  # async: the shards' answers
        assert all(v == pytest.approx(0.1) for _, v in s["train/lr_pushed"]) and all(
            v > 0 for _, v in s["train/step_seconds"]
        )
        pushed = [v for _, v in s["comm/pushed_bytes"]]
        assert pushed == sorted(pushed) and pushed[0] > 0
        assert s["eval/accuracy"] == [(20, pytest.approx(summary["accuracy_per_rank"][rank]))] and "eval/loss" in s
    # README's TensorBoard picture is drawn from such a directory (scripts/render_watch.py)
    drawn = render_watch.render_tensorboard(tb, tmp_path / "tensorboard.png")
    assert drawn == dict.fromkeys(["train/loss", "train/step_seconds", "train/staleness", "comm/pushed_bytes"], 2)
    assert (tmp_path / "tensorboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


SCRIPT = """
import os
import torch
from ps_worker import DistributedOptimizer, PSClient
from ps_worker.tensorboard import TrainingLog

steps = int(os.environ["PS_STEPS"])
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
client = PSClient.from_env(model)
opt = DistributedOptimizer(model, client)
with TrainingLog.from_env() as curves:  # PS_TENSORBOARD, PS_TENSORBOARD_EVERY, PS_RANK
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = model(torch.ones(8, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        curves.log_step(opt, loss=loss, step=step)
    curves.log_eval({"loss": float(model(torch.ones(8, 4)).pow(2).mean())}, step=steps)
client.close()
"""


def test_a_user_script_writes_the_same_curves_through_training_log(tmp_path) -> None:
    """What ps-launch --tensorboard sets for a script (tests/unit/test_tensorboard.py), in a
    single-process job: the script's own shard, no cluster to start."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PS_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(PS_TENSORBOARD=str(tmp_path / "tb"), PS_TENSORBOARD_EVERY="2", PS_STEPS="6")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [p.name for p in (tmp_path / "tb").iterdir()] == ["rank-0"]
    s = scalars(tmp_path / "tb" / "rank-0")
    assert [step for step, _ in s["train/loss"]] == [1, 2, 4, 6]
    assert [step for step, _ in s["comm/pulled_bytes"]] == [1, 2, 4, 6] and "train/lr_pushed" in s
    assert [step for step, _ in s["eval/loss"]] == [6]


BREAKING_SCRIPT = """
import os, shutil
import torch
from ps_worker import DistributedOptimizer, PSClient
from ps_worker.tensorboard import TrainingLog

steps = int(os.environ["PS_STEPS"])
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
client = PSClient.from_env(model)
opt = DistributedOptimizer(model, client)
with TrainingLog.from_env() as curves:
    for step in range(1, steps + 1):
        if step == 6:  # the run's directory is replaced by a file mid-run (a cleanup job, a full disk...)
            curves.writer.flush()
            shutil.rmtree(curves.path)
            curves.path.write_text("not a directory")
        opt.zero_grad()
        loss = model(torch.ones(8, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        curves.log_step(opt, loss=loss, step=step)
    curves.log_eval({"loss": float(loss)}, step=steps)
client.close()
print(f"rank {client.rank} trained to step {steps}")
"""


def test_a_tensorboard_directory_that_breaks_mid_run_costs_one_warning_not_the_worker(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(BREAKING_SCRIPT)
    tb, logs = tmp_path / "tb", tmp_path / "logs"
    argv = ["--workers", "2", "--steps", "30", "--json", "--log-dir", str(logs), "--tensorboard", str(tb)]
    out = subprocess.run(
        [*LAUNCH, *argv, "--tensorboard-every", "2", str(script)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps_run_per_rank"] == [30, 30]
    for rank in (0, 1):
        log = (logs / f"worker-{rank}.log").read_text()
        assert f"rank {rank} trained to step 30" in log
        warned = [line for line in log.splitlines() if "TensorBoard: writing" in line]
        assert len(warned) == 1 and "no more curves from this rank, and training goes on" in warned[0], log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        assert (tb / f"rank-{rank}").read_text() == "not a directory"
