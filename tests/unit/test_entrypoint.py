"""The worker images' entry point: which program a container runs (ps_worker.entrypoint)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ps_worker.entrypoint import UsageError, main, resolve

PY = "/opt/grpc-ps/bin/python"


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        ([], {}, ["ps-worker"]),
        (["digits", "--steps", "5"], {"PS_WORKLOAD": "linreg"}, ["ps-worker", "digits", "--steps", "5"]),
        (["--steps", "5"], {}, ["ps-worker", "--steps", "5"]),
        (["train.py", "--epochs", "3"], {}, [PY, "train.py", "--epochs", "3"]),
        (["-m", "pkg.train", "--lr", "0.1"], {}, [PY, "-m", "pkg.train", "--lr", "0.1"]),
        (["--epochs", "3"], {"PS_SCRIPT": "/opt/user/train.py"}, [PY, "/opt/user/train.py", "--epochs", "3"]),
        ([], {"PS_MODULE": "pkg.train"}, [PY, "-m", "pkg.train"]),
        # arguments win over the environment, as flags win over their twins
        (["other.py"], {"PS_SCRIPT": "/opt/user/train.py"}, [PY, "other.py"]),
        (["-m", "a.b"], {"PS_SCRIPT": "/x.py", "PS_MODULE": "c.d"}, [PY, "-m", "a.b"]),
        ([], {"PS_SCRIPT": "  "}, ["ps-worker"]),
    ],
)
def test_resolve(argv: list[str], environ: dict[str, str], expected: list[str]) -> None:
    assert resolve(argv, environ, python=PY) == expected


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["-m"], {}, "-m needs a module"),
        (["-m", "--steps"], {}, "-m needs a module"),
        ([], {"PS_SCRIPT": "/x.py", "PS_MODULE": "c.d"}, "both set"),
    ],
)
def test_usage_errors(argv: list[str], environ: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        resolve(argv, environ, python=PY)


def test_a_missing_script_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "nope.py")]) == 2
    assert "no script" in capsys.readouterr().err


def test_the_script_replaces_the_entrypoint_with_args_env_and_exit_status(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\nprint(os.getpid(), sys.argv[1:], os.environ['PS_RANK'], os.environ['RANK'], "
        "os.environ['WORLD_SIZE'])\nsys.exit(int(sys.argv[1]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env |= {"PS_RANK": "1", "PS_NUM_WORKERS": "2", "PS_SCRIPT": str(script)}
    done = subprocess.Popen(
        [sys.executable, "-m", "ps_worker.entrypoint", "3", "--epochs", "2"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = done.communicate(timeout=60)
    assert done.returncode == 3
    pid, rest = out.split(" ", 1)
    assert int(pid) == done.pid, "exec: the script is the container's process itself (signals reach it)"
    assert rest.strip() == "['3', '--epochs', '2'] 1 1 2"  # torchrun's RANK, WORLD_SIZE from PS_*


def test_torchrun_s_variables_come_from_the_contract_and_never_override() -> None:
    from ps_worker.entrypoint import torchrun_variables

    env = {"PS_RANK": "3", "PS_NUM_WORKERS": "4"}
    assert torchrun_variables(env) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    assert torchrun_variables({**env, "RANK": "9", "LOCAL_RANK": "2"}) == {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1"}
    assert torchrun_variables({"PS_RANK": "3"}) == {} and torchrun_variables({}) == {}
