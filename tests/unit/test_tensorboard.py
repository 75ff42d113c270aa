"""ps_worker.tensorboard: the scalars a rank writes, read back with TensorBoard's own reader."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ps_launch.cli import launch_parser
from ps_launch.run import run
from ps_launch.target import script_environment, worker_argv
from ps_worker.env import EnvError
from ps_worker.tensorboard import INSTALL, QUEUE_SCALARS, TensorBoardMissing, TrainingLog, require
from ps_worker.workloads.cli import main as worker_main
from ps_worker.workloads.flags import worker_parser


def scalars(run_dir) -> dict[str, list[tuple[int, float]]]:  # noqa: ANN001
    """tag -> [(step, value)] of the one event file in ``run_dir``."""
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def fake_client(local: bool = False) -> SimpleNamespace:
    """What the log reads of a PSClient: its counters and whether its mode steps locally."""
    mode = SimpleNamespace(local_optimizer=local)
    return SimpleNamespace(pushed_bytes=0, pulled_bytes=0, staleness=Counter(), worker_mode=mode)


def test_a_rank_writes_means_at_its_steps_the_lr_pushes_carry_staleness_bytes_and_held_out_scores(tmp_path) -> None:
    client = fake_client()
    opt = SimpleNamespace(param_groups=[{"lr": 0.1}, {"lr": 0.01}], client=client)  # a DistributedOptimizer's face
    with TrainingLog(tmp_path, rank=3, every=5) as log:
        for step in range(1, 13):
            client.pushed_bytes, client.pulled_bytes = 100 * step, 200 * step
            client.staleness[step % 3] += 1  # the shards' answers: staleness 1, 2, 0, 1, ...
            log.log_step(opt, loss=torch.tensor(float(step)), step=step, step_seconds=0.01 * step)
        log.log_eval({"accuracy": 0.9, "loss": 0.3, "auc": None, "bits_per_char": float("nan")}, step=12)
    s = scalars(tmp_path / "rank-3")
    assert s["train/loss"] == [(1, 1.0), (5, 3.5), (10, 8.0), (12, 11.5)]  # means since the previous point
    assert [(st, round(v, 4)) for st, v in s["train/step_seconds"]] == [(1, 0.01), (5, 0.035), (10, 0.08), (12, 0.115)]
    assert s["train/lr_pushed"] == [(step, pytest.approx(0.1)) for step in (1, 5, 10, 12)]
    assert [st for st, _ in s["train/lr_pushed/group1"]] == [1, 5, 10, 12]
    assert s["comm/pushed_bytes"] == [(1, 100), (5, 500), (10, 1000), (12, 1200)]
    assert s["comm/pulled_bytes"][-1] == (12, 2400)
    # step 1 pushed with staleness 1; steps 2-5 with 2, 0, 1, 2; steps 6-10 with 0, 1, 2, 0, 1; 11-12 with 2, 0
    assert s["train/staleness"] == [(1, 1.0), (5, 1.25), (10, pytest.approx(0.8)), (12, 1.0)]
    assert s["train/staleness_max"] == [(1, 1), (5, 2), (10, 2), (12, 2)]
    assert s["eval/accuracy"] == [(12, pytest.approx(0.9))] and s["eval/loss"] == [(12, pytest.approx(0.3))]
    assert "eval/auc" not in s and "eval/bits_per_char" not in s and "train/lr_local" not in s


def test_a_local_optimizer_s_lr_is_lr_local_and_step_seconds_come_from_the_calls(tmp_path) -> None:
    opt = SimpleNamespace(param_groups=[{"lr": 0.5}])  # a torch optimizer's face, no client: it steps on the worker
    easgd = SimpleNamespace(param_groups=[{"lr": 0.25}], client=fake_client(local=True))
    with TrainingLog(tmp_path, rank=0, every=2) as log, TrainingLog(tmp_path, rank=1, every=1) as other:
        for step in range(1, 5):
            log.log_step(opt, loss=1.0, step=step)
            other.log_step(easgd, loss=2.0, step=step)
    s = scalars(tmp_path / "rank-0")
    assert s["train/lr_local"] == [(1, 0.5), (2, 0.5), (4, 0.5)]
    assert [st for st, _ in s["train/step_seconds"]] == [2, 4] and all(v > 0 for _, v in s["train/step_seconds"])
    assert not any(t.startswith(("comm/", "train/staleness", "train/lr_pushed")) for t in s)  # no client
    t = scalars(tmp_path / "rank-1")
    assert [st for st, _ in t["train/lr_local"]] == [1, 2, 3, 4] and "train/staleness" not in t


def test_without_a_directory_nothing_is_written_and_from_env_reads_the_launch_variables(tmp_path) -> None:
    off = TrainingLog.from_env({})
    assert not off.enabled
    off.log_step(None, loss=1.0, step=1)
    off.log_eval({"accuracy": 1.0}, 1)
    off.close()
    env = {"PS_TENSORBOARD": str(tmp_path), "PS_RANK": "1", "PS_NUM_WORKERS": "2", "PS_TENSORBOARD_EVERY": "3"}
    log = TrainingLog.from_env(env)
    log.close()
    assert log.path == tmp_path / "rank-1" and log.every == 3 and list(tmp_path.iterdir()) == [tmp_path / "rank-1"]
    with pytest.raises(EnvError, match="PS_TENSORBOARD_EVERY"):
        TrainingLog.from_env({**env, "PS_TENSORBOARD_EVERY": "0"})


def test_ps_launch_forwards_the_directory_absolute_to_ps_worker_and_to_scripts(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = launch_parser({}).parse_args(["--tensorboard", "tb", "--tensorboard-every", "4", "digits"])
    argv = worker_argv(args, ["127.0.0.1:1"], 0)
    forwarded = worker_parser({}).parse_args(argv[1:])
    assert (forwarded.tensorboard, forwarded.tensorboard_every) == (str(tmp_path / "tb"), 4)
    env = script_environment(args, ["127.0.0.1:1"], 1)
    assert (env["PS_TENSORBOARD"], env["PS_TENSORBOARD_EVERY"]) == (str(tmp_path / "tb"), "4")
    plain = launch_parser({}).parse_args(["digits"])
    assert "--tensorboard" not in worker_argv(plain, ["127.0.0.1:1"], 0)
    assert "PS_TENSORBOARD" not in script_environment(plain, ["127.0.0.1:1"], 0)


def test_without_the_package_both_commands_fail_at_start_naming_the_install(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what `import tensorboard` sees when it is not installed
    with pytest.raises(TensorBoardMissing, match=r"pip install 'grpc-ps\[tensorboard\]'"):
        require()
    with pytest.raises(TensorBoardMissing):
        TrainingLog(tmp_path / "a")
    argv = ["--servers", "127.0.0.1:1", "--rank", "0", "--num-workers", "1", "--tensorboard", str(tmp_path / "w")]
    assert worker_main(argv) == 2
    assert f"ps-worker: --tensorboard needs the tensorboard package, which is not installed: {INSTALL}" in (
        capsys.readouterr().err
    )
    args = launch_parser({}).parse_args(["--tensorboard", str(tmp_path / "l"), "--log-dir", str(tmp_path / "logs")])
    assert run(args) == 2  # before any process starts (no socket either: this is a unit test)
    err = capsys.readouterr().err
    assert INSTALL in err and "started" not in err
    assert not any(tmp_path.iterdir())  # nothing created


def test_the_commands_load_neither_torch_nor_tensorboard_to_parse_their_flags() -> None:
    """ps-launch imports ps_worker.tensorboard; its --help and ps-worker's stay fast."""
    code = (
        "import sys, ps_launch.cli, ps_worker.workloads.cli, ps_worker.tensorboard; "
        "ps_launch.cli.launch_parser({}).parse_args(['--tensorboard', 'tb', 'digits']); "
        "print('torch' in sys.modules, 'tensorboard' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr


class FailingWriter:
    """A SummaryWriter whose disk went away after ``good`` scalars: every later call raises."""

    def __init__(self, good: int) -> None:
        self.good, self.written, self.closes = good, 0, 0

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self.written >= self.good:
            raise NotADirectoryError(20, "Not a directory", "rank-0/events.out.tfevents")
        self.written += 1

    def close(self) -> None:
        self.closes += 1
        raise NotADirectoryError(20, "Not a directory")


def test_a_failing_writer_turns_the_log_off_with_one_warning(caplog) -> None:
    writer = FailingWriter(good=2)
    log = TrainingLog("unused", rank=3, every=1, writer=writer)
    caplog.set_level("WARNING", logger="ps_worker.tensorboard")
    for step in range(1, 20):
        log.log_step(loss=1.0, step=step, step_seconds=0.01)  # never raises
    log.log_eval({"accuracy": 0.9}, step=19)
    log.close()
    assert not log.enabled and writer.written == 2 and writer.closes == 1
    (warned,) = [r for r in caplog.records if r.name == "ps_worker.tensorboard"]
    assert "rank 3's curves" in warned.getMessage() and "NotADirectoryError" in warned.getMessage()
    assert "training goes on" in warned.getMessage()


class StalledWriter:
    """A SummaryWriter whose disk hangs until ``release`` is set (an NFS server gone quiet)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.written = 0

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        assert self.release.wait(60), "never released"
        self.written += 1

    def close(self) -> None:
        pass


def test_a_stalled_disk_never_blocks_a_step_and_drops_points_with_one_warning(caplog) -> None:
    writer = StalledWriter()
    log = TrainingLog("unused", rank=0, every=1, writer=writer)
    caplog.set_level("WARNING", logger="ps_worker.tensorboard")
    began = time.perf_counter()
    steps = 2 * QUEUE_SCALARS  # 2 scalars a point: the queue fills halfway through
    for step in range(1, steps + 1):
        log.log_step(loss=1.0, step=step, step_seconds=0.01)
    assert time.perf_counter() - began < 10  # no step waited for the disk (each point: microseconds)
    (stalled,) = [r.getMessage() for r in caplog.records]
    assert "points are dropped until it catches up, and training goes on" in stalled
    writer.release.set()
    log.close()
    assert QUEUE_SCALARS <= writer.written < 2 * steps  # what was queued reached the disk; the rest was dropped
