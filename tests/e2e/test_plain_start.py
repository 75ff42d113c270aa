"""``ps-server`` started plainly (no ``GLIBC_TUNABLES``, as a user, a container runtime or a
StatefulSet starts it) runs with grpc-ps's malloc tuning all the same: it restarts itself with it
before serving, keeping its PID (performance issue: no dependence on environment variables for speed)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from ps_common.process_env import GLIBC_TUNABLES
from tests.helpers.processes import wait_for_listening

SERVER = Path(sys.executable).with_name("ps-server")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the restart is for glibc's malloc only")
@pytest.mark.timeout(120)
def test_plain_ps_server_runs_with_the_malloc_tuning_under_its_own_pid() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    argv = [str(SERVER), "--num-shards", "1", "--shard-index", "0", "--num-workers", "1"]
    proc = subprocess.Popen(
        [*argv, "--port", "0", "--metrics-port", "-1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait_for_listening(proc)
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()  # the PID Popen started: same process
        assert b"GLIBC_TUNABLES=" + GLIBC_TUNABLES.split(":")[0].encode() in environ
        assert Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[1:3] == [
            str(SERVER).encode(),
            b"--num-shards",
        ]
    finally:
        proc.terminate()
        proc.wait(30)
