"""ps-launch's side of the shard host (:mod:`ps_server.host`; docs/architecture.md#start-up): start
it, learn the PIDs of the shards it forks, and follow them as ps-launch's own children.

A fresh job's S shards on this machine start from one process that imports torch, grpcio and
``torch._dynamo`` once and forks them, instead of S processes that each pay those imports on the
cores the workers are importing on (bench/README.md, "Time to first step"). ps-launch marks itself
the children's subreaper (``PR_SET_CHILD_SUBREAPER``) while the host runs, so when the host exits
the shards are reparented to ps-launch: :class:`ForkedProcess` waits for them (``waitpid``), reads
their exit status and signals them by their real PID, as ``subprocess.Popen`` does for the shards
it starts itself. Where the host cannot apply (no subreaper, the host failed or would not fork)
:meth:`ShardHost.shards` says so and ps-launch starts plain ``ps-server`` processes.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

PR_SET_CHILD_SUBREAPER = 36
SHARD_PID = re.compile(r"^shard (\d+) pid (\d+)$", re.MULTILINE)


def set_subreaper(on: bool) -> bool:
    """Make this process the subreaper of its descendants (``on``) or stop being one; False where
    Linux refuses (then orphans go to init, and the host cannot be used)."""
    try:
        return int(ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


class ForkedProcess:
    """A shard the host forked, now a child of this process: what ps-launch uses of
    ``subprocess.Popen`` (``pid``, ``stdout``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``terminate``, ``kill``), over ``os.waitpid``.

    ``returncode`` is the exit status, or minus the signal that ended it (as ``Popen``'s).
    """

    def __init__(self, pid: int, stdout: IO[str]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.args = ["ps-server", f"(forked by the shard host, pid {pid})"]
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        """The exit status once the process ended (reaped here), else None."""
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: the status is lost, it is gone
                    self.returncode = 255
                else:
                    if pid == self.pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit status.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        stop = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while (code := self.poll()) is None:
            if stop is not None and time.monotonic() >= stop:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(delay if stop is None else min(delay, max(0.0, stop - time.monotonic())))
            delay = min(delay * 2, 0.02)
        return code

    def send_signal(self, sig: int) -> None:
        """Signal the process unless it was reaped (its PID may then be another process's)."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ShardHost:
    """A started ``python -m ps_server.host``: ``proc`` is its ``Popen``; :meth:`shards` waits for
    its forks.

    Args:
        argvs: each shard's ``ps-server`` arguments, in shard order.
        logs: each shard's log, its stderr.
        host_log: the host's own stderr.
        env: the host's environment (its shards inherit it).
        preexec: run in the host before it starts (ps-launch's ``PR_SET_PDEATHSIG``).
        warm: the host imports ``torch._dynamo`` before it forks (else each shard does).
    """

    def __init__(
        self,
        argvs: Sequence[Sequence[str]],
        logs: Sequence[IO[str]],
        host_log: IO[str],
        env: Mapping[str, str],
        preexec: Callable[[], None],
        warm: bool = True,
    ) -> None:
        pipes = [os.pipe() for _ in argvs]
        self.reads = [r for r, _ in pipes]
        spec = {
            "launcher": os.getpid(),
            "warm": warm,
            "shards": [
                {"argv": list(a), "stdout": w, "stderr": log.fileno()}
                for a, (_, w), log in zip(argvs, pipes, logs, strict=True)
            ],
        }
        passed = (*(w for _, w in pipes), *(log.fileno() for log in logs))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ps_server.host", json.dumps(spec)],
                stdout=subprocess.PIPE,
                stderr=host_log,
                text=True,
                env=dict(env),
                preexec_fn=preexec,
                start_new_session=True,
                pass_fds=passed,
            )
        except BaseException:
            for r in self.reads:
                os.close(r)
            raise
        finally:
            for _, w in pipes:
                os.close(w)

    def shards(self, deadline: float) -> list[ForkedProcess] | None:
        """Wait (up to ``deadline`` seconds) for the host to fork every shard and exit; the shards,
        now children of this process, or None when the host failed (why: in its log) — then any
        shard it forked is killed, and nothing is left to stop."""
        try:
            out, _ = self.proc.communicate(timeout=deadline)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=30)
        pids = {int(k): int(pid) for k, pid in SHARD_PID.findall(out or "")}
        if self.proc.returncode == 0 and sorted(pids) == list(range(len(self.reads))):
            return [ForkedProcess(pids[k], os.fdopen(r, "r")) for k, r in enumerate(self.reads)]
        for pid in pids.values():  # reparented to this process: end and reap them
            forked = ForkedProcess(pid, open(os.devnull))  # noqa: SIM115 - closed below
            forked.kill()
            forked.wait(timeout=30)
            forked.stdout.close()
        for r in self.reads:
            os.close(r)
        return None
