"""A script with no grpc-ps-specific environment runs under plain ``python`` (a single-process job on a
shard of its own, :mod:`ps_worker.embedded`) and, unchanged, under ``ps-launch`` (torchrun's variables
set too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from ps_worker import DistributedOptimizer, PSClient
from ps_worker.env import EnvError

SCRIPT = """
import os
import torch
from torch.utils.data import DataLoader, TensorDataset
from ps_worker import DistributedOptimizer, DistributedSampler, PSClient

torch.manual_seed(0)
x = torch.randn(40, 4)
dataset = TensorDataset(x, x.sum(1, keepdim=True))
sampler = DistributedSampler(dataset)  # no process group: the rank comes from the environment
loader = DataLoader(dataset, batch_size=4, sampler=sampler)
model = torch.nn.Linear(4, 1)
client = PSClient.from_env(model, optimizer={"name": "sgd", "lr": 0.05})
opt = DistributedOptimizer(model, client)
steps, first = 0, None
for epoch in range(2):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        steps += 1
torchrun = [os.environ.get(k, "-") for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")]
print(f"ran {steps} steps, loss {first:.3f} -> {loss.item():.3f}, torchrun {' '.join(torchrun)}, "
      f"master {'MASTER_ADDR' in os.environ}, sampler {sampler.rank}/{sampler.num_replicas}")
"""
"""torch and ps_worker's three names only; it never closes its client (the shard stops at exit)."""

EXIT_TIMEOUT = 120.0
"""Seconds a run of the script may take, start-up of torch included."""


def clean_env() -> dict[str, str]:
    """This test's environment without any grpc-ps or torchrun variable."""
    torchrun = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if not k.startswith("PS_") and k not in torchrun}


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_plain_python_runs_a_single_process_job_and_exits(script) -> None:
    out = subprocess.run(
        [sys.executable, str(script)], env=clean_env(), capture_output=True, text=True, timeout=EXIT_TIMEOUT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "grpc-ps: PS_SERVERS is not set: running as a single-process job with an in-process shard on 127.0.0.1:" in (
        out.stderr
    )
    assert "; launch with ps-launch for a cluster" in out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("ran 20 steps, loss ") and line.endswith("torchrun - - - -, master False, sampler 0/1")
    first, last = (float(v) for v in line.split("loss ")[1].split(",")[0].split(" -> "))
    assert last < first / 4  # it trained


def test_the_same_script_runs_under_ps_launch_with_torchrun_s_variables(tmp_path, script) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ps_launch.cli", "--shards", "2", "--workers", "2", "--no-progress", "--no-metrics"]
        + ["--json", "--log-dir", str(tmp_path / "logs"), str(script)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=EXIT_TIMEOUT * 2,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "single-process" not in out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    said = [r["last_line"] for r in summary["ranks"]]
    for r in (0, 1):  # half the data each: 5 steps an epoch
        assert said[r].startswith("ran 10 steps, loss "), said
        # ps-launch sets torchrun's whole environment, MASTER_ADDR included (a process group may form)
        assert said[r].endswith(f"torchrun {r} 2 {r} 2, master True, sampler {r}/2"), said
    assert summary["steps_run_per_rank"] == [10, 10] and summary["steps"] == 300  # PS_STEPS, not what ran
    assert "steps run per rank  [10, 10] (PS_STEPS was 300; the script ran its own count)" in out.stdout


def test_from_env_starts_a_shard_that_stops_when_the_client_closes(monkeypatch, capfd) -> None:
    """In this process: the client is rank 0 of 1 on 127.0.0.1, trains, and its close stops the shard
    and joins its threads."""
    for name in list(os.environ):
        if name.startswith("PS_") or name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PS_MODE", "async")
    before = set(threading.enumerate())
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    client = PSClient.from_env(model, {"name": "sgd", "lr": 0.1}, timeout=10.0)
    (stop,) = client.on_close
    shard = stop.__self__
    assert client.rank == 0 and client.num_workers == 1 and client.servers == [shard.address]
    assert shard.address.startswith("127.0.0.1:") and client.mode == "async"
    assert f"in-process shard on {shard.address} (async)" in capfd.readouterr().err
    opt = DistributedOptimizer(model, client)
    before_step = model.weight.detach().clone()
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    assert not torch.equal(model.weight, before_step)
    client.close()
    assert shard.server.stopped
    leftover = [t for t in set(threading.enumerate()) - before if t.is_alive() and t.name.startswith("shard")]
    assert not leftover, leftover
    shard.stop()  # idempotent


def test_an_unknown_ps_mode_is_named_and_nothing_starts(monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith("PS_") or name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PS_MODE", "ssp2")
    with pytest.raises(EnvError, match="^PS_MODE='ssp2': Unknown mode 'ssp2'; expected one of"):
        PSClient.from_env(torch.nn.Linear(2, 1))
