"""ps-launch's processes: shards and workers started on this machine, watched and stopped.

Every child runs in its own session with ``PR_SET_PDEATHSIG`` (SIGTERM when the launcher dies, even
by SIGKILL); :meth:`Cluster.stop` ends every one of them. Also the flags it forwards to every
``ps-server``. The shards' status as ps-launch reads it: :mod:`ps_launch.status`; the shard host
that starts a fresh job's shards for the cost of one start-up: :mod:`ps_launch.shard_host`.
"""

from __future__ import annotations

import ctypes
import json
import queue
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ps_common import modes
from ps_launch.shard_host import ForkedProcess, ShardHost, set_subreaper

LISTENING = re.compile(r"listening on (\S+)")
METRICS = re.compile(r"metrics on (http://\S+)")
PR_SET_PDEATHSIG = 1


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Ask Linux to send SIGTERM to this child when the launcher dies (even by SIGKILL), and take
    back the stop signals the launcher blocks while it spawns."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    """One started process and where its output goes."""

    name: str
    proc: subprocess.Popen[str] | ForkedProcess
    log_path: Path
    log_file: IO[str]
    argv: list[str] = field(default_factory=list)
    """What follows ``python -m`` (or ``python``, for a script: see ``python_args``)."""
    events: list[dict[str, Any]] = field(default_factory=list)
    metrics_url: str | None = None
    python_args: tuple[str, ...] = ("-m",)
    extra_env: dict[str, str] = field(default_factory=dict)
    """Variables of this process only (a user script's contract: ``PS_RANK``...)."""
    last_lines: deque[str] = field(default_factory=lambda: deque(maxlen=5))
    """The last lines it printed on stdout (a user script's own summary)."""


class Cluster:
    """Local shard and worker processes; :meth:`stop` ends every one of them.

    Args:
        log_dir: where each process's log goes.
        env: the environment of every process (``PYTHONUNBUFFERED=1`` is added).
    """

    def __init__(self, log_dir: Path, env: Mapping[str, str], shard_host: bool = False) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []
        self.env = {**env, "PYTHONUNBUFFERED": "1"}
        self.shard_host = shard_host
        """Start a fresh job's shards from one forking process (:mod:`ps_launch.shard_host`)."""

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        extra_env: Mapping[str, str] | None = None,
        python_args: Sequence[str] = ("-m",),
    ) -> Child:
        """Start ``python {python_args} {argv}`` as ``name`` (log: ``LOG_DIR/{name}.log``, appended to)
        with the cluster's environment and ``extra_env``."""
        log_path = self.log_dir / f"{name}.log"
        log_file = open(log_path, "a")  # noqa: SIM115 - closed in stop(); appended to on a restart
        # Ctrl-C between fork and registration would leave a child nobody stops: hold it until then.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            proc = subprocess.Popen(
                [sys.executable, *python_args, *argv],
                stdout=subprocess.PIPE,
                stderr=log_file,
                text=True,
                env={**self.env, **(extra_env or {})},
                preexec_fn=_die_with_parent,
                start_new_session=True,
            )
            child = Child(
                name,
                proc,
                log_path,
                log_file,
                argv=list(argv),
                python_args=tuple(python_args),
                extra_env=dict(extra_env or {}),
            )
            self.children.append(child)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        print(f"ps-launch: started {name} (pid {proc.pid})", file=sys.stderr, flush=True)
        return child

    def respawn(self, child: Child) -> Child:
        """Start ``child``'s command again, with its environment, under its name."""
        return self.spawn(child.name, child.argv, child.extra_env, child.python_args)

    def start_shards(
        self,
        n: int,
        workers: int,
        mode: str,
        extra: Sequence[str] = (),
        deadline: float = 60.0,
        metrics: bool = True,
        reserved: Sequence[socket.socket] = (),
        meanwhile: Callable[[list[str]], None] | None = None,
    ) -> list[str]:
        """Start ``n`` shards on free ports (``extra``: more ps-server flags; ``/metrics`` too, unless
        ``metrics`` is False); returns their addresses in shard order.

        With ``reserved`` (:func:`reserve_ports`, one per shard) shard ``k`` binds the port of
        ``reserved[k]`` (``--reuse-port``), and ``meanwhile`` is called with the addresses once every
        shard is started, before they serve: the workers start while the shards import torch. The
        sockets are closed when this returns or raises.

        Raises:
            RuntimeError: a shard exited or did not report its port in time.
        """
        try:
            return self._start_shards(n, workers, mode, extra, deadline, metrics, reserved, meanwhile)
        finally:
            for s in reserved:
                s.close()

    def _start_shards(
        self,
        n: int,
        workers: int,
        mode: str,
        extra: Sequence[str],
        deadline: float,
        metrics: bool,
        reserved: Sequence[socket.socket],
        meanwhile: Callable[[list[str]], None] | None,
    ) -> list[str]:
        ports = [str(s.getsockname()[1]) for s in reserved] or ["0"] * n
        argvs = [
            [
                "ps_server.cli",
                "--shard-index",
                str(k),
                "--num-shards",
                str(n),
                "--num-workers",
                str(workers),
                "--mode",
                mode,
                "--host",
                "127.0.0.1",
                "--port",
                ports[k],
                *(["--reuse-port"] if reserved else []),
                "--metrics-port",
                "0" if metrics else "-1",
                *extra,
            ]
            for k in range(n)
        ]
        host = self._start_host(argvs) if reserved and self.shard_host else None
        shards = [] if host else [self.spawn(f"shard-{k}", argv) for k, argv in enumerate(argvs)]
        if meanwhile is not None and reserved:
            meanwhile([f"127.0.0.1:{port}" for port in ports])
        if host is not None:
            shards = self._hosted(*host, argvs, deadline)
        found: queue.Queue[tuple[int, str | None]] = queue.Queue()
        for k, child in enumerate(shards):
            threading.Thread(target=self._read_address, args=(k, child, found), daemon=True).start()
        addresses: dict[int, str] = {}
        stop = time.monotonic() + deadline
        while len(addresses) < n:
            try:
                k, addr = found.get(timeout=max(0.01, stop - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"Shards did not start within {deadline:.0f} s; see {self.log_dir}") from None
            if addr is None:
                raise RuntimeError(f"shard-{k} exited before serving:\n{tail(shards[k].log_path)}")
            if reserved and addr != f"127.0.0.1:{ports[k]}":
                raise RuntimeError(f"shard-{k} serves on {addr}, not on its reserved port {ports[k]}")
            addresses[k] = addr
        return [addresses[k] for k in range(n)]

    def _start_host(self, argvs: list[list[str]]) -> tuple[ShardHost, list[IO[str]]] | None:
        """Start the shard host of ``argvs`` (registered as ``shard_host``) and open the shards'
        logs; None where this process cannot be the shards' subreaper."""
        if not set_subreaper(True):
            return None
        logs: list[IO[str]] = [open(self.log_dir / f"shard-{k}.log", "a") for k in range(len(argvs))]  # noqa: SIM115 - Child's
        host_log = open(self.log_dir / "shard_host.log", "a")  # noqa: SIM115 - closed in stop()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            host = ShardHost([a[1:] for a in argvs], logs, host_log, self.env, _die_with_parent)
            self.children.append(Child("shard_host", host.proc, Path(host_log.name), host_log, ["ps_server.host"]))
        except OSError as exc:
            print(f"ps-launch: the shard host did not start ({exc}); starting each shard on its own", file=sys.stderr)
            set_subreaper(False)
            for log in (*logs, host_log):
                log.close()
            return None
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        print(
            f"ps-launch: started shard_host (pid {host.proc.pid}): imports torch once, then forks the "
            f"{len(argvs)} shards",
            file=sys.stderr,
            flush=True,
        )
        return host, logs

    def _hosted(self, host: ShardHost, logs: list[IO[str]], argvs: list[list[str]], deadline: float) -> list[Child]:
        """The shards the host forked, as children of this process; plain ones if it failed."""
        try:
            forked = host.shards(deadline)
        finally:
            set_subreaper(False)
        if forked is None:
            print(f"ps-launch: the shard host failed ({self.log_dir / 'shard_host.log'}); starting each shard on its "
                  "own", file=sys.stderr)  # fmt: skip
            for log in logs:
                log.close()
            return [self.spawn(f"shard-{k}", argv) for k, argv in enumerate(argvs)]
        shards = [
            Child(f"shard-{k}", p, Path(log.name), log, argvs[k])
            for k, (p, log) in enumerate(zip(forked, logs, strict=True))
        ]
        self.children.extend(shards)
        for c in shards:
            print(f"ps-launch: started {c.name} (pid {c.proc.pid}) from the shard host", file=sys.stderr, flush=True)
        return shards

    def restart_shard(self, child: Child, address: str, deadline: float = 60.0) -> Child:
        """Start a killed shard again with its command, on its old port; returns the new child.

        Raises:
            RuntimeError: it did not serve again within ``deadline`` seconds.
        """
        argv = list(child.argv)
        argv[argv.index("--port") + 1] = address.rsplit(":", 1)[1]
        new = self.spawn(child.name, argv)
        found: queue.Queue[tuple[int, str | None]] = queue.Queue()
        threading.Thread(target=self._read_address, args=(0, new, found), daemon=True).start()
        try:
            _, addr = found.get(timeout=deadline)
        except queue.Empty:
            raise RuntimeError(f"{child.name} did not serve again within {deadline:.0f} s") from None
        if addr is None:
            raise RuntimeError(f"{child.name} exited when restarted:\n{tail(new.log_path)}")
        return new

    @staticmethod
    def _read_address(k: int, child: Child, found: queue.Queue[tuple[int, str | None]]) -> None:
        assert child.proc.stdout is not None
        for line in child.proc.stdout:
            url = METRICS.search(line)
            if url:
                child.metrics_url = url.group(1)
            m = LISTENING.search(line)
            if m:
                found.put((k, m.group(1)))
                break
        else:
            found.put((k, None))
            return
        for line in child.proc.stdout:  # keep draining so the shard never blocks on stdout
            child.log_file.write(line)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every live child, wait ``grace`` seconds, SIGKILL what is left."""
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        stop = time.monotonic() + grace
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.01, stop - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(timeout=5)
            c.log_file.close()


def reserve_ports(n: int, host: str = "127.0.0.1") -> list[socket.socket]:
    """``n`` sockets bound to free ports of ``host`` with ``SO_REUSEPORT``, not listening: while they
    are open no other socket can bind those ports (nor get one for an outgoing connection), except a
    ``ps-server --reuse-port`` on it, and a connection to one is refused (a worker's Join retries).
    Empty where the system refuses (no ``SO_REUSEPORT``): start the shards first then."""
    held: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((host, 0))
    except (OSError, AttributeError):
        for s in held:
            s.close()
        return []
    return held


def cluster_id(log_dir: Path) -> str:
    """The job's ``--cluster-id``: drawn once per log directory and kept in ``LOG_DIR/cluster-id``, so
    that a job resumed on its ``--log-dir`` keeps its id and no other job's membership record is
    followed by its shards."""
    path = log_dir / "cluster-id"
    try:
        saved = path.read_text().strip()
    except FileNotFoundError:
        saved = ""
    if saved:
        return saved
    made = f"launch-{secrets.token_hex(12)}"
    path.write_text(made + "\n")
    return made


def server_flags(args: Any, log_dir: Path) -> list[str]:
    """The mode, checkpoint and cluster parameters ps-launch forwards to every ps-server."""
    flags = [
        "--cluster-id",
        cluster_id(log_dir),
        "--checkpoint-dir",
        str(log_dir / "checkpoints"),
        "--checkpoint-every",
        str(1 if args.durable_acks else args.checkpoint_every),
        *(["--durable-acks"] if args.durable_acks else []),
        "--lease-timeout",
        str(args.lease_timeout),
        "--join-timeout",
        str(args.join_timeout),
    ]
    return flags + modes.forward_flags(args)  # every mode parameter, from ps_common.modes' one table


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def read_events(child: Child, events: queue.Queue[tuple[str, dict[str, Any]]]) -> None:
    """Forward a worker's JSON lines to ``events``; other lines go to its log."""
    assert child.proc.stdout is not None
    for line in child.proc.stdout:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            child.log_file.write(line)
            continue
        events.put((child.name, event))
    events.put((child.name, {"event": "exit"}))


def read_output(child: Child, events: queue.Queue[tuple[str, dict[str, Any]]]) -> None:
    """A user script's stdout: every line goes to its log; a line that is a JSON object with an ``event``
    is also forwarded to ``events``, the last few others are kept in ``child.last_lines``. Then ``exit``."""
    assert child.proc.stdout is not None
    for line in child.proc.stdout:
        child.log_file.write(line)
        child.log_file.flush()
        event = None
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                pass
        if isinstance(event, dict) and "event" in event:
            events.put((child.name, event))
        elif line.strip():
            child.last_lines.append(line.rstrip("\n"))
    events.put((child.name, {"event": "exit"}))
