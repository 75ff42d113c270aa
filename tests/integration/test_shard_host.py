"""The shard host's pieces (docs/architecture.md#start-up): a process forked by another one that exits
is this process's child once it is the subreaper, and ForkedProcess follows it as Popen would; the
host refuses a bad spec before importing anything. The whole path runs in tests/e2e/test_launch.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ps_launch.shard_host import ForkedProcess, set_subreaper

FORK_AND_EXIT = """
import os, sys, time
pid = os.fork()
if pid == 0:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the host's stdout ends with the host
    deadline = time.monotonic() + 30  # not adopted (no subreaper): end instead of waiting forever
    while os.getppid() != int(sys.argv[1]):
        if time.monotonic() > deadline:
            os._exit(3)
        time.sleep(0.002)
    time.sleep(int(sys.argv[2]))
    os._exit(int(sys.argv[3]))
print(pid, flush=True)
"""
"""A host in miniature: forks a child (which waits to be adopted, sleeps, exits) and exits."""


def forked(seconds: int, code: int) -> ForkedProcess:
    host = subprocess.Popen(
        [sys.executable, "-c", FORK_AND_EXIT, str(os.getpid()), str(seconds), str(code)],
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = host.communicate(timeout=60)
    return ForkedProcess(int(out.split()[0]), open(os.devnull))  # noqa: SIM115 - closed by the test


@pytest.fixture
def subreaper():
    if not set_subreaper(True):
        pytest.skip("PR_SET_CHILD_SUBREAPER refused")
    yield
    set_subreaper(False)


def test_a_forked_process_is_followed_to_its_exit_status(subreaper) -> None:
    proc = forked(0, 7)
    try:
        assert proc.wait(timeout=30) == 7
        assert proc.poll() == 7 and proc.returncode == 7
        proc.kill()  # reaped: nothing is signalled (its PID may be another process's by now)
    finally:
        proc.stdout.close()


def test_a_forked_process_is_killed_and_its_signal_read(subreaper) -> None:
    proc = forked(60, 0)
    try:
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.05)
        proc.kill()
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.stdout.close()


def test_the_host_refuses_a_bad_spec_before_importing_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ps_server.host", "not json"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2, out.stderr
    assert "bad spec" in out.stderr
