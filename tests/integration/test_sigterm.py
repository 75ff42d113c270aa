"""A test run stopped with SIGTERM ends the processes its tests started (``tests/conftest.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STOPPED_RUN = """
import subprocess, sys, time
from pathlib import Path

import pytest

OUT = Path({out!r})


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (OUT / "child.pid").write_text(str(proc.pid))
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_waits_to_be_stopped(child):
    (OUT / "ready").write_text("1")
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _until(done, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_run_stopped_with_sigterm_tears_its_fixtures_down(tmp_path: Path) -> None:
    (tmp_path / "test_stopped.py").write_text(STOPPED_RUN.format(out=str(tmp_path)))
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), str(tmp_path / "test_stopped.py")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    pid = 0
    try:
        _until(lambda: (tmp_path / "ready").exists() or run.poll() is not None, 60, "the inner test never started")
        assert run.poll() is None, run.communicate(timeout=30)[0]
        pid = int((tmp_path / "child.pid").read_text())
        run.send_signal(signal.SIGTERM)
        out = run.communicate(timeout=60)[0]
        assert run.returncode != 0, out  # stopped, not passed
        _until(lambda: not _alive(pid), 10, f"the fixture's process {pid} outlived the stopped run:\n{out}")
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=30)
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)
