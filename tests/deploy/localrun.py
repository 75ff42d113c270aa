"""Run resolved deployment :class:`~deployment.Process` entries as local processes on 127.0.0.1.

The only changes from what the containers get are the ones a single machine forces, all in
:func:`localize`: shards bind 127.0.0.1 on a port of their own choosing (``PS_PORT=0``), service
names in ``PS_SERVERS`` become those ports, checkpoints and metrics get a private directory and a
free port, and a CUDA device becomes the CPU. Processes run in their own session and are ended by
their process-group id; every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from deployment import PENDING_FLAG_ENV, VENV_BIN, Process

LISTENING = re.compile(r"listening on (\S+)")
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def localize(
    process: Process,
    own_env: set[str],
    other_env: set[str],
    addresses: dict[str, str],
    deploy_ports: dict[str, str],
    workdir: Path,
) -> dict[str, str]:
    """The process's environment, moved from a cluster onto 127.0.0.1.

    Args:
        process: the resolved service or pod.
        own_env: PS_* names its command's --help lists.
        other_env: PS_* names the other command's --help lists (a shared ConfigMap sets both).
        addresses: DNS name of a shard -> its local ``127.0.0.1:port``.
        deploy_ports: DNS name of a shard -> the port it listens on in the deployment.
        workdir: private directory (HOME, checkpoints).

    Raises:
        AssertionError: a PS_* variable no command reads (a typo), or PS_SERVERS names a host or
            port no shard has.
    """
    env = {k: process.files.get(v, v) for k, v in process.env.items()}  # a mounted secret's path: its file here
    if "PS_HOST" in env:
        assert env["PS_HOST"] in ("0.0.0.0", "::"), f"{process.name}: PS_HOST={env['PS_HOST']}: bind all interfaces"
        env["PS_HOST"] = LOOPBACK  # never bind anything but loopback here
    if "PS_PORT" in env:
        env["PS_PORT"] = "0"  # the shard picks a free port and prints it
    if "PS_DATA_PORT" in env:
        env["PS_DATA_PORT"] = "0"  # likewise; Join tells the workers
    if "PS_CHECKPOINT_DIR" in env:
        env["PS_CHECKPOINT_DIR"] = str(workdir / "checkpoints")
    if "PS_METRICS_PORT" in env:
        env["PS_METRICS_PORT"] = str(free_port())
    if env.get("PS_DEVICE", "").startswith("cuda"):
        env["PS_DEVICE"] = "cpu"  # no GPU on this machine; the GPU images say cuda
    if "PS_SERVERS" in env:
        local = []
        for entry in env["PS_SERVERS"].split(","):
            host, _, port = entry.strip().rpartition(":")
            assert host in addresses, f"{process.name}: PS_SERVERS names {host!r}; shards are {sorted(addresses)}"
            listens = deploy_ports[host]
            assert port == listens, f"{process.name} dials {entry}, but {host} listens on {listens}"
            local.append(addresses[host])
        env["PS_SERVERS"] = ",".join(local)
    unread = {k for k in env if k.startswith("PS_") and k not in own_env}
    stray = unread - other_env - PENDING_FLAG_ENV
    assert not stray, f"{process.name}: {sorted(stray)} are read by neither ps-server nor ps-worker (a typo?)"
    # The one accommodation while --metrics-port and --checkpoint-dir are being added: drop their
    # variables for a command whose --help does not list them yet. It disappears once they land.
    for name in unread & PENDING_FLAG_ENV:
        del env[name]
    workdir.mkdir(parents=True, exist_ok=True)
    return {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8", **env}


class Running:
    """A started process, its stdout and stderr collected line by line."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], workdir: Path) -> None:
        self.name = name
        self.env = env
        self.lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._changed = threading.Condition()
        self.popen = subprocess.Popen(
            argv,
            env=env,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, ended by its id
        )
        self._readers = [
            threading.Thread(target=self._read, args=(stream,), name=f"{stream}-{name}", daemon=True)
            for stream in ("stdout", "stderr")
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: str) -> None:
        pipe = getattr(self.popen, stream)
        for line in pipe:
            with self._changed:
                self.lines[stream].append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for_line(self, pattern: re.Pattern[str], timeout: float, stream: str = "stdout") -> re.Match[str]:
        """The first line of ``stream`` matching ``pattern``, within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                lines = self.lines[stream]
                for line in lines[seen:]:
                    match = pattern.search(line)
                    if match:
                        return match
                seen = len(lines)
                left = deadline - time.monotonic()
                ended = self.popen.poll() is not None and not any(r.is_alive() for r in self._readers)
                if left <= 0 or ended:
                    raise AssertionError(f"{self.name}: no {stream} line matching {pattern.pattern!r}\n{self.tail()}")
                self._changed.wait(min(left, 1.0))

    def summary(self) -> dict[str, Any]:
        """The worker's final JSON summary (``"event": "done"``) from its stdout."""
        for line in reversed(self.lines["stdout"]):
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("event") == "done":
                    return record
        raise AssertionError(f"{self.name}: no JSON summary on stdout\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        with self._changed:
            out, err = self.lines["stdout"][-lines:], self.lines["stderr"][-lines:]
        return "\n".join([f"--- {self.name} stdout", *out, f"--- {self.name} stderr", *err])

    def group_alive(self) -> bool:
        """Whether any process of its process group is still there."""
        try:
            os.killpg(self.popen.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def wait_group_gone(self, timeout: float) -> bool:
        """Whether its whole process group is gone within ``timeout`` seconds (orphans reaped)."""
        deadline = time.monotonic() + timeout
        while self.group_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)  # poll interval; the deadline bounds the wait
        return True

    def end(self, grace: float = 5.0) -> None:
        """SIGTERM its process group, SIGKILL what is left after ``grace`` seconds."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.popen.poll() is None or self.group_alive():
                try:
                    os.killpg(self.popen.pid, sig)
                except ProcessLookupError:
                    pass
                try:
                    self.popen.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    continue
        for reader in self._readers:
            reader.join(timeout=5)


def wait_until_healthy(argv: list[str], env: dict[str, str], timeout: float, what: str) -> None:
    """Run a health check command until it exits 0 (as compose and the kubelet poll), within ``timeout``."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)
        if done.returncode == 0:
            return
        last = done.stdout + done.stderr
        time.sleep(0.5)  # the probe period between polls; the deadline bounds the wait
    raise AssertionError(f"{what} not healthy within {timeout} s: {last}")
