"""The environment ps-launch gives its children: malloc tunables and threads, unless the user set them."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from ps_common.process_env import GLIBC_TUNABLES, available_cpus, launch_environment


def test_defaults_are_added_and_the_rest_is_kept() -> None:
    env = launch_environment({"PATH": "/bin"}, processes=4, cpus=16)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": GLIBC_TUNABLES, "OMP_NUM_THREADS": "4"}
    assert GLIBC_TUNABLES.split(":") == [
        "glibc.malloc.hugetlb=1",
        "glibc.malloc.mmap_max=0",
        "glibc.malloc.trim_threshold=4000000000",
        "glibc.malloc.arena_max=1",
    ]


@pytest.mark.parametrize(("processes", "cpus", "threads"), [(4, 2, "1"), (3, 8, "2"), (1, 1, "1"), (2, 3, "1")])
def test_threads_share_the_cpus_and_never_drop_below_one(processes: int, cpus: int, threads: str) -> None:
    assert launch_environment({}, processes, cpus)["OMP_NUM_THREADS"] == threads


def test_the_users_values_win_even_empty() -> None:
    mine = {"GLIBC_TUNABLES": "", "OMP_NUM_THREADS": "7"}
    assert launch_environment(mine, processes=2, cpus=64) == mine
    assert launch_environment({"OMP_NUM_THREADS": "7"}, 2, 64)["GLIBC_TUNABLES"] == GLIBC_TUNABLES


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        launch_environment({}, processes=0, cpus=2)
    assert available_cpus() >= 1


SCRIPT = (
    "import os, sys\n"
    "print('before', os.getpid(), flush=True)\n"
    "from ps_common.process_env import tune_malloc_at_start\n"
    "tune_malloc_at_start()\n"
    "print('after', os.getpid(), repr(os.environ.get('GLIBC_TUNABLES')), sys.argv[1:], flush=True)\n"
)


def _run_script(env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, "--flag", "x y"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the restart is for glibc's malloc only")
def test_a_process_started_without_the_tuning_restarts_itself_with_it_keeping_its_pid_and_arguments() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    before, again, after = _run_script(env)
    assert before.startswith("before ") and again == before  # the same PID ran the script's start twice
    assert after == f"after {before.split()[1]} {GLIBC_TUNABLES!r} ['--flag', 'x y']"


def test_a_tuning_the_user_set_is_kept_and_an_empty_one_turns_it_off() -> None:
    for value in ("", "glibc.malloc.arena_max=2"):
        env = {**os.environ, "GLIBC_TUNABLES": value}
        before, after = _run_script(env)
        assert after == f"after {before.split()[1]} {value!r} ['--flag', 'x y']"
