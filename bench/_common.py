"""Shared helpers of the benchmark: child processes, their line protocol, the environment, statistics.

The orchestrator (``run.py``) starts every measured process itself and talks to it over its
stdin/stdout, one JSON object per line: it sends ``{"cmd": NAME, ...}`` and the child answers
``{"ok": true, ...}`` or ``{"error": "..."}``. A child prints ``{"ready": true, ...}`` once set
up. Every wait has a deadline and every child is killed by its pid when the run ends.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from ps_common.process_env import GLIBC_TUNABLES  # given to every measured system alike: a fair comparison

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent

PR_SET_PDEATHSIG = 1


def child_env(threads: int) -> dict[str, str]:
    """The environment of every measured process: glibc tunables, ``threads`` intra-op threads,
    unbuffered output, the repository importable."""
    env = dict(os.environ)
    env.update(
        GLIBC_TUNABLES=GLIBC_TUNABLES,
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for torch.distributed's tcp:// init)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """SIGTERM this child when the orchestrator dies, even by SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class ChildError(RuntimeError):
    """A child exited, answered with an error, or missed a deadline."""


class Child:
    """One started process; its stdout lines arrive on a queue read by a thread.

    Args:
        name: for messages and its log file.
        argv: the command (``sys.executable`` first).
        env: its environment.
        log_dir: where its stderr goes (``NAME.log``).
        cwd: its working directory (the repository; another checkout's for ``run.py --before``).
    """

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], log_dir: Path, cwd: Path = ROOT) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log: IO[str] = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=dict(env),
            cwd=cwd,
            preexec_fn=_die_with_parent,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"read-{name}", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _next_line(self, deadline: float, what: str) -> str:
        try:
            line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise ChildError(f"{self.name}: no answer to {what} in time; see {self.log_path}") from None
        if line is None:
            raise ChildError(f"{self.name} exited ({self.proc.wait(timeout=10)}) during {what}:\n{self.tail()}")
        return line

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first stdout line matching ``pattern`` (earlier lines go to the log).

        Raises:
            ChildError: the child exited or ``timeout`` seconds passed.
        """
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        for _ in range(100_000):
            line = self._next_line(deadline, f"/{pattern}/")
            m = regex.search(line)
            if m:
                return m
            self._log.write(line)
        raise ChildError(f"{self.name}: too much output before /{pattern}/")

    def recv(self, timeout: float, what: str = "a command") -> dict[str, Any]:
        """The next JSON line from the child (other lines go to its log).

        Raises:
            ChildError: exited, missed ``timeout``, or answered ``{"error": ...}``.
        """
        deadline = time.monotonic() + timeout
        for _ in range(100_000):
            line = self._next_line(deadline, what)
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                self._log.write(line)
                continue
            if "error" in msg:
                raise ChildError(f"{self.name} failed at {what}: {msg['error']}")
            return msg
        raise ChildError(f"{self.name}: too much output during {what}")

    def send(self, cmd: str, **args: Any) -> None:
        """Write ``{"cmd": cmd, **args}`` to the child's stdin."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise ChildError(f"{self.name} is gone ({exc}):\n{self.tail()}") from exc

    def tail(self, lines: int = 20) -> str:
        self._log.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float = 5.0) -> None:
        """Close stdin (children leave their loop), SIGTERM after ``grace`` seconds, SIGKILL by pid."""
        if self.proc.poll() is None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    os.kill(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=10)
        self._log.close()


def shard_argv(k: int, shards: int, workers: int) -> list[str]:
    """The command of shard ``k`` of a sync cluster for a benchmark: a free port (printed), no
    metrics endpoint, a lease long enough for any step."""
    argv = [sys.executable, "-m", "ps_server.cli", "--shard-index", str(k), "--num-shards", str(shards)]
    return argv + [
        "--num-workers",
        str(workers),
        "--mode",
        "sync",
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--lease-timeout",
        "300",
    ]


def start_shards(
    shards: int, workers: int, env: dict[str, str], log_dir: Path, timeout: float = 120.0
) -> tuple[list[Child], list[str]]:
    """Start ``shards`` shard processes; returns (children, addresses). The caller stops them
    (on an error here, they are stopped before it is raised).

    Raises:
        ChildError: a shard did not report its address within ``timeout`` seconds.
    """
    children: list[Child] = []
    try:
        for k in range(shards):
            children.append(Child(f"shard{k}", shard_argv(k, shards, workers), env, log_dir))
        return children, [c.wait_for(r"listening on (\S+)", timeout).group(1) for c in children]
    except BaseException:
        for c in children:
            c.stop(grace=0.0)
        raise


def ask_all(children: Sequence[Child], cmd: str, timeout: float, **args: Any) -> list[dict[str, Any]]:
    """Send ``cmd`` to every child at once, then collect every answer within ``timeout`` seconds."""
    for c in children:
        c.send(cmd, **args)
    deadline = time.monotonic() + timeout
    return [c.recv(max(0.01, deadline - time.monotonic()), cmd) for c in children]


def stop_all(children: Sequence[Child], grace: float = 5.0) -> None:
    """Close every child's stdin at once, then stop each (SIGTERM, SIGKILL by pid) within ``grace``."""
    for c in children:
        try:
            if c.proc.stdin is not None and c.proc.poll() is None:
                c.proc.stdin.close()
        except OSError:
            pass
    deadline = time.monotonic() + grace
    for c in children:
        c.stop(grace=max(0.01, deadline - time.monotonic()))


# ---------------------------------------------------------------------- child side
def reply(msg: Mapping[str, Any]) -> None:
    """Write one JSON line to stdout (the orchestrator's end of the protocol)."""
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def serve(handlers: Mapping[str, Callable[..., Mapping[str, Any] | None]]) -> None:
    """Answer commands from stdin until EOF or ``{"cmd": "exit"}``; ``handlers[cmd](**args)``
    returns the answer's fields. An exception is answered with its traceback and ends the loop."""
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        cmd = msg.pop("cmd")
        if cmd == "exit":
            reply({"ok": True})
            return
        try:
            reply({"ok": True, **(handlers[cmd](**msg) or {})})
        except Exception:  # noqa: BLE001 - the orchestrator shows it and stops the run
            reply({"error": traceback.format_exc()})
            return


def timed(step: Callable[[], object], iters: int, warmup: int) -> list[float]:
    """Seconds of each of ``iters`` calls of ``step`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return samples


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all threads (/proc/PID/stat fields 14, 15);
    0.0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot (/proc/stat's ``cpu`` line; busy is all
    but idle and iowait: user, nice, system, irq, softirq and steal, so also the kernel's network
    work that no process is charged for)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def busy_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The fraction of the machine's CPU time that was busy between two :func:`machine_ticks`."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


# ---------------------------------------------------------------------- memory
PROCESS_BASE_BYTES = 400 << 20
"""Memory of one measured process before any payload (torch and gRPC imported): 230–330 MB RSS
measured here (session 11); rounded up."""

HEADROOM_BYTES = 1 << 30
"""Memory always left free, for the kernel's socket buffers, page cache and the orchestrator."""


class HeadroomError(RuntimeError):
    """The next system could exhaust the machine's memory (the kernel's OOM killer would then end
    processes at random, this run's or others'); the run stops before it, with what to leave out."""


def memory_available() -> int:
    """Bytes the kernel can give new allocations without swapping (/proc/meminfo ``MemAvailable``)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def check_headroom(need: int, what: str) -> None:
    """Raise :class:`HeadroomError` unless ``need`` bytes (plus :data:`HEADROOM_BYTES`) are available.

    Args:
        need: bytes ``what`` may allocate from now on (an estimate from the measured factors).
        what: the step about to run, for the message (e.g. "set up grpc-ps 2w×2s at 100MB").
    """
    free = memory_available()
    if free < need + HEADROOM_BYTES:
        raise HeadroomError(
            f"Not enough memory to {what}: {free >> 20} MiB available, it may need {need >> 20} MiB "
            f"plus {HEADROOM_BYTES >> 20} MiB kept free. Every system of a size is alive at once (they "
            "alternate round by round); measure fewer at a time: --sizes, --grid, --systems, --wire-dtypes."
        )


# ---------------------------------------------------------------------- statistics
def describe(samples: Sequence[float]) -> dict[str, float]:
    """Median, min and max of positive samples (seconds)."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}
