"""What ps-launch runs as each worker (ps_launch.target): a workload, a script, a module."""

from __future__ import annotations

import argparse

import pytest

from ps_launch.cli import launch_parser
from ps_launch.target import Target, TargetError, script_environment, split_argv
from ps_worker.env import read_env


@pytest.fixture
def train_py(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return "train.py"


def test_a_built_in_workload_keeps_every_flag_for_ps_launch() -> None:
    p = launch_parser({})
    argv = ["--shards", "1", "digits", "--steps", "5"]
    assert split_argv(argv, p) == (argv, None)
    assert split_argv(["nosuchworkload"], p) == (["nosuchworkload"], None)  # argparse refuses it by name


def test_a_script_ends_ps_launch_s_flags_and_keeps_its_own(train_py: str) -> None:
    p = launch_parser({})
    own, target = split_argv(["--shards", "1", "--no-progress", "--log-dir", "x.py", train_py, "--lr", "3"], p)
    assert own == ["--shards", "1", "--no-progress", "--log-dir", "x.py"]  # a flag's value is not the script
    assert target == Target("script", "train.py", ("--lr", "3"))
    assert target.label == "train.py" and target.command()[1] == ()
    assert split_argv(["--steps=5", train_py], p) == (["--steps=5"], Target("script", "train.py"))
    assert split_argv(["--", train_py, "a"], p) == ([], Target("script", "train.py", ("a",)))


def test_a_module_and_its_arguments() -> None:
    p = launch_parser({})
    own, target = split_argv(["--workers", "3", "-m", "pkg.train", "--workers", "9"], p)
    assert own == ["--workers", "3"] and target == Target("module", "pkg.train", ("--workers", "9"))
    assert target.label == "-m pkg.train" and target.command() == (["pkg.train", "--workers", "9"], ("-m",))
    with pytest.raises(TargetError, match="-m needs a module"):
        split_argv(["-m"], p)


def test_a_missing_script_is_named(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TargetError, match="script 'nope.py' not found"):
        split_argv(["--shards", "1", "nope.py"], launch_parser({}))


def test_the_script_s_environment_is_the_contract() -> None:
    args = argparse.Namespace(
        workers=2,
        steps=40,
        batch_size=16,
        optimizer="adam",
        lr=0.01,
        momentum=0.9,
        seed=3,
        timeout=30.0,
        wire_dtype="bfloat16",
        topk=0.0,
        master_port=29512,
    )
    env = script_environment(args, ["127.0.0.1:1", "127.0.0.1:2"], 1)
    s = read_env(env)
    assert s.servers == ("127.0.0.1:1", "127.0.0.1:2") and (s.rank, s.num_workers, s.steps) == (1, 2, 40)
    assert (s.batch_size, s.optimizer, s.lr, s.seed, s.timeout, s.wire_dtype) == (16, "adam", 0.01, 3, 30.0, "bfloat16")
    torchrun = {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    assert torchrun == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    # the whole torchrun environment: a gloo process group may form beside grpc-ps (metrics, barriers)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29512")
