"""A chaos soak of a real sync job: process management, fault injection and the invariants.

Three layers, usable on their own:

- **Pure checks** (:func:`check_no_hang`, :func:`check_params_identical`, :func:`check_push_accounting`,
  :func:`check_accuracy`, :func:`check_exits`): plain data in, a :class:`Finding` out. No process, no
  socket; ``tests/unit/test_chaos_harness.py`` feeds them synthetic logs and shows each one can fail.
- **Processes** (:class:`Network`, :class:`Cluster`): ``ps-server`` shards and ``ps-worker digits``
  ranks as subprocesses, each with its own log file, optionally each in a network namespace of its
  own that this module creates (and deletes). Every process is ended by its PID, never by name.
- **Faults** (:class:`FaultInjector`): a seeded random sequence of kill -9, SIGSTOP/SIGCONT and link
  cuts, each bounded in time, spaced by random pauses, stopped at a deadline.

The workers run with ``--events``: one JSON line per step (``{"event": "step", "rank", "step"}``,
printed after the step's PushPull was answered by every shard) and a ``done`` line with the summary.
``ps-worker`` prints at most one step event per 0.1 s; every worker here runs ``--slow-rank <its own
rank> --slow-ms 105``, so every step takes longer than 0.1 s and *every* step is printed: the harness
sees each acknowledged step, which the push accounting needs (see :func:`check_push_accounting`).
"""

from __future__ import annotations

import json
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable

SUPERVISOR_RESTARTS = 2
"""Restarts per rank of a worker that failed on its own (the job then still ends, and is judged)."""

SLOW_MS = 105.0
"""Every worker sleeps this long before each push: a step lasts > 0.1 s, so each one is printed."""


# ============================================================================ pure data and checks
@dataclass
class Finding:
    """The outcome of one invariant: its name, whether it holds, and the why (for the report and
    the assertion message)."""

    name: str
    ok: bool
    detail: str

    def __str__(self) -> str:
        return f"[{'ok' if self.ok else 'FAIL'}] {self.name}: {self.detail}"


@dataclass
class Incarnation:
    """What one worker process of a rank printed and how it ended.

    Attributes:
        rank, incarnation: who (the incarnation is passed with ``--incarnation``).
        start: the ``start`` event's step (the step it resumed at), None if it never started training.
        steps: every ``step`` event's step value, in order (the step count after that step).
        step_times: the harness's monotonic time of receipt of each step event.
        done: the ``done`` summary (``--json``), None if it never finished.
        killed: the harness killed it (kill -9).
        returncode: its exit status (None while running).
        refused: pushes it logged as refused ("push refused as too stale"; ``--log-level INFO``).
    """

    rank: int
    incarnation: int
    start: int | None = None
    steps: list[int] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    done: dict[str, Any] | None = None
    killed: bool = False
    returncode: int | None = None
    refused: int = 0

    @property
    def last_step(self) -> int | None:
        return self.steps[-1] if self.steps else self.start

    def acknowledged(self) -> int:
        """Steps whose PushPull every shard answered: one printed event each (``--slow-ms`` makes
        every step longer than the events' 0.1 s throttle). The printed step is the round a sync
        rank holds next, which a rank counted again after an eviction skips ahead, so events are
        counted, not step numbers subtracted."""
        return len(self.steps)

    def refused_pushes(self) -> int:
        """Refused pushes: the summary's count when it finished, else the count in its log."""
        if self.done is not None:
            return int(self.done.get("refused_pushes", 0)) + int(self.done.get("dropped_pushes", 0))
        return self.refused

    def max_unprinted(self) -> int:
        """Steps it may have completed after its last printed one and before it died: 0 when it
        finished; else 1 (the step in flight, possibly applied but never acknowledged) plus the
        largest jump between two consecutive printed steps minus one (0 when every step was printed,
        as the harness arranges with ``--slow-ms``; a larger value only widens the bound)."""
        if self.done is not None:
            return 0
        seq = ([self.start] if self.start is not None else []) + self.steps
        jumps = [b - a for a, b in zip(seq, seq[1:], strict=False)]
        return 1 + max([j - 1 for j in jumps] + [0])


@dataclass(frozen=True)
class Hold:
    """An interval the test itself kept a shard from serving (stopped or down): [start, end]."""

    what: str
    start: float
    end: float


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of closed intervals, as sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap(a: float, b: float, intervals: Sequence[tuple[float, float]]) -> float:
    """Length of [a, b] covered by disjoint ``intervals``."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in intervals)


def longest_hang(step_times: Iterable[float], holds: Iterable[Hold]) -> tuple[float, float, float]:
    """The longest stretch without any rank's step, the shard holds subtracted.

    Args:
        step_times: times of every step event of every rank and incarnation.
        holds: intervals during which the test kept a shard stopped or down.

    Returns:
        (longest gap with the held time inside it subtracted, that gap's start, its raw length);
        (0, 0, 0) with fewer than two steps.
    """
    times = sorted(step_times)
    held = merge((h.start, h.end) for h in holds)
    best = (0.0, 0.0, 0.0)
    for a, b in zip(times, times[1:], strict=False):
        unexplained = (b - a) - overlap(a, b, held)
        if unexplained > best[0]:
            best = (unexplained, a, b - a)
    return best


def check_no_hang(
    step_times: Iterable[float], holds: Iterable[Hold], bound: float, origin: float = 0.0, end: float | None = None
) -> tuple[Finding, float]:
    """Invariant 1: between the first and the last step of the job, no stretch longer than
    ``bound`` seconds passed without some rank completing a step, not counting the time the test
    itself held a shard stopped (SIGSTOP) or down (killed, until its restart listens again).

    Worker faults (kill, stop, partition) are not subtracted: the other ranks must go on once the
    lapsed lease evicts the silent rank, so their gap is at most the lease plus slack.

    Args:
        end: when the job did not finish, the time the harness stopped waiting for it: the stretch
            from the last step to ``end`` counts too (a job wedged for good is a hang).

    Returns:
        The finding and the measured longest unexplained gap (seconds).
    """
    times = list(step_times)
    if end is not None and times:
        times.append(end)
    gap, at, raw = longest_hang(times, holds)
    detail = (
        f"longest stretch without any step: {gap:.1f} s of shard-available time "
        f"(raw gap {raw:.1f} s from t={at - origin:.1f} s); bound {bound:.1f} s"
    )
    return Finding("no hang", gap <= bound, detail), gap


def check_params_identical(finals: Sequence[Incarnation]) -> Finding:
    """Invariant 2: the final incarnation of every rank finished and printed the same
    ``params_sha256`` (sync mode: every rank reads the same final versions of every shard)."""
    missing = [f.rank for f in finals if f.done is None]
    if missing:
        return Finding("identical parameters", False, f"ranks {missing} printed no summary")
    done = [(f.rank, f.done) for f in finals if f.done is not None]
    distinct = {str(d["params_sha256"]) for _, d in done}
    detail = ", ".join(f"rank {r}: {str(d['params_sha256'])[:12]} (version {d.get('version')})" for r, d in done)
    return Finding("identical parameters", len(distinct) == 1, detail)


@dataclass(frozen=True)
class PushCount:
    """One rank's pushes on one shard: what the workers say (bounds) and what the shard applied."""

    shard: int
    rank: int
    applied: int
    low: int
    high: int

    @property
    def ok(self) -> bool:
        return self.low <= self.applied <= self.high


def push_counts(incarnations: Sequence[Incarnation], applied: Sequence[Sequence[int]]) -> list[PushCount]:
    """Per shard and rank, the applied count next to the bounds the workers' output sets.

    ``applied[k][r]`` is shard k's ``WorkerStatus.pushes`` of rank r at the end: in sync mode the
    pushes of r the shard accepted into a round, over every incarnation of r, kept in checkpoints
    and so restored with the rounds they belong to when a shard restarts. Every step a worker prints
    is one push per shard, answered by every shard (acknowledged):

    - low = sum over incarnations of (acknowledged steps - refused pushes): each acknowledged push
      is in exactly one round of every shard unless a shard refused it (a refused push completes the
      step without being applied: counted by the worker). An acknowledged push lost (a shard resumed
      from a checkpoint older than a round it had answered) takes the count below ``low``.
    - high = sum over incarnations of (acknowledged steps + :meth:`Incarnation.max_unprinted`): a
      push no process saw answered (its process was killed) may be applied at most once. A push
      applied twice (a retry or a replay after a restart applied again) takes the count above.
    """
    out = []
    ranks = sorted({i.rank for i in incarnations})
    for k, row in enumerate(applied):
        for r in ranks:
            mine = [i for i in incarnations if i.rank == r]
            low = sum(i.acknowledged() - i.refused_pushes() for i in mine)
            high = sum(i.acknowledged() + i.max_unprinted() for i in mine)
            out.append(PushCount(k, r, int(row[r]), low, high))
    return out


def check_push_accounting(incarnations: Sequence[Incarnation], applied: Sequence[Sequence[int]]) -> Finding:
    """Invariant 3: every acknowledged push applied exactly once on every shard, an unacknowledged
    one at most once (see :func:`push_counts` for the bounds and why they hold)."""
    counts = push_counts(incarnations, applied)
    bad = [c for c in counts if not c.ok]
    lines = [
        f"shard {c.shard} rank {c.rank}: applied {c.applied}, acknowledged bounds [{c.low}, {c.high}]"
        + ("" if c.ok else (" -> LOST acknowledged pushes" if c.applied < c.low else " -> APPLIED TWICE"))
        for c in counts
    ]
    return Finding("each acknowledged push applied exactly once", not bad and bool(counts), "; ".join(lines))


def check_accuracy(finals: Sequence[Incarnation], minimum: float) -> Finding:
    """Invariant 4: every rank's final model reaches ``minimum`` held-out accuracy."""
    accs = {f.rank: (None if f.done is None else f.done.get("accuracy")) for f in finals}
    bad = [r for r, a in accs.items() if a is None or a < minimum]
    detail = ", ".join(f"rank {r}: {'-' if a is None else f'{a:.4f}'}" for r, a in sorted(accs.items()))
    return Finding(f"accuracy >= {minimum}", not bad, detail)


def check_exits(incarnations: Sequence[Incarnation], shard_exits: Sequence[str]) -> Finding:
    """Every worker process ended as the test meant: killed by it, or finished (exit 0, summary
    printed); and no shard exited on its own (``shard_exits``: descriptions of such exits)."""
    bad = [
        f"rank {i.rank} incarnation {i.incarnation}: exit {i.returncode}"
        for i in incarnations
        if not i.killed and (i.returncode != 0 or i.done is None)
    ]
    bad += list(shard_exits)
    return Finding("no process failed on its own", not bad, "; ".join(bad) or "every process ended as intended")


# ============================================================================ network namespaces
def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a short command (``ip``), with a timeout."""
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)


class Network:
    """Where the processes run: each shard-side and worker-side in its own network namespace, or
    all on 127.0.0.1 when namespaces cannot be made (not root, no ``ip``).

    With namespaces: one namespace ``<tag>s`` holds a bridge with the shards' address; each worker
    rank r has a namespace ``<tag>w<r>`` joined to the bridge by a veth pair. Only addresses inside
    these namespaces are used, and nothing is dialled from the root namespace. A partition of rank r
    sets its end of the veth pair down; restoring sets it up again.
    """

    def __init__(self, num_workers: int, want: bool = True) -> None:
        self.num_workers = num_workers
        tag = f"cs{os.getpid() % 100000}"
        self.tag = tag
        self.shard_ns = f"{tag}s"
        self.worker_ns = [f"{tag}w{r}" for r in range(num_workers)]
        self.subnet = f"10.232.{os.getpid() % 250}"
        self.enabled = False
        self.why_not = ""
        self.host = "127.0.0.1"
        if not want:
            self.why_not = "disabled"
            return
        if os.geteuid() != 0 or shutil.which("ip") is None:
            self.why_not = "network namespaces need root and iproute2"
            return
        try:
            self._create()
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            self.why_not = f"cannot create network namespaces: {getattr(exc, 'stderr', '') or exc}".strip()
            self.close()
            return
        self.enabled = True
        self.host = f"{self.subnet}.1"

    def _create(self) -> None:
        s, br = self.shard_ns, f"{self.tag}br"
        sh("ip", "netns", "add", s)
        sh("ip", "-n", s, "link", "set", "lo", "up")
        sh("ip", "-n", s, "link", "add", br, "type", "bridge")
        sh("ip", "-n", s, "addr", "add", f"{self.subnet}.1/24", "dev", br)
        sh("ip", "-n", s, "link", "set", br, "up")
        for r, ns in enumerate(self.worker_ns):
            inner, outer = self.link(r), f"{self.tag}p{r}"
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", s)
            sh("ip", "-n", ns, "addr", "add", f"{self.subnet}.{10 + r}/24", "dev", inner)
            sh("ip", "-n", ns, "link", "set", inner, "up")
            sh("ip", "-n", s, "link", "set", outer, "master", br)
            sh("ip", "-n", s, "link", "set", outer, "up")

    def link(self, rank: int) -> str:
        """The worker-side interface of rank ``rank``."""
        return f"{self.tag}c{rank}"

    def prefix(self, ns: str | None) -> list[str]:
        """The argv prefix that runs a command in namespace ``ns`` (none without namespaces)."""
        return ["ip", "netns", "exec", ns] if self.enabled and ns else []

    def cut(self, rank: int) -> None:
        """Partition rank ``rank`` from the shards: its link goes down."""
        sh("ip", "-n", self.worker_ns[rank], "link", "set", self.link(rank), "down")

    def restore(self, rank: int) -> None:
        """End rank ``rank``'s partition."""
        sh("ip", "-n", self.worker_ns[rank], "link", "set", self.link(rank), "up")

    def close(self) -> None:
        """Delete every namespace this object made (their veth pairs and the bridge go with them)."""
        for ns in [self.shard_ns, *self.worker_ns]:
            sh("ip", "netns", "del", ns, check=False)


def free_port() -> int:
    """A port free now (bind 0, read, close); shards reuse it across restarts."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ============================================================================ processes
STATUS_SCRIPT = r"""
import json, sys, grpc
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
addrs = sys.argv[1:]
chans = [grpc.insecure_channel(a) for a in addrs]
stubs = [ps_pb2_grpc.AdminStub(c) for c in chans]
for line in sys.stdin:
    out = []
    for a, stub in zip(addrs, stubs):
        try:
            st = stub.GetStatus(ps_pb2.GetStatusRequest(), timeout=5).status
        except grpc.RpcError as exc:
            out.append({"address": a, "error": exc.code().name})
            continue
        out.append({
            "address": a, "version": st.version,
            "restored_from": st.restored_from_version if st.HasField("restored_from_version") else None,
            "last_checkpoint": st.last_checkpoint_version if st.HasField("last_checkpoint_version") else None,
            "workers": [{"rank": w.rank, "incarnation": w.incarnation, "clock": w.clock, "pushes": w.pushes,
                         "state": ps_pb2.WorkerState.Name(w.state)} for w in st.workers],
        })
    print(json.dumps(out), flush=True)
"""


class Lines:
    """A thread that reads a process's stdout line by line into a queue (and a copy to a file)."""

    def __init__(self, stream: IO[str], copy: IO[str], on_line: Callable[[str, float], None] | None = None) -> None:
        self.queue: queue.Queue[str | None] = queue.Queue()
        self._on_line = on_line
        self._copy = copy
        self.thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self.thread.start()

    def _run(self, stream: IO[str]) -> None:
        for line in stream:
            now = time.monotonic()
            self._copy.write(line)
            self._copy.flush()
            if self._on_line is not None:
                self._on_line(line, now)
            self.queue.put(line)
        self.queue.put(None)

    def expect(self, predicate: Callable[[str], bool], timeout: float) -> str | None:
        """The first line matching ``predicate`` within ``timeout`` s; None at the deadline or EOF."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                line = self.queue.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                return None
            if predicate(line):
                return line


@dataclass
class Process:
    """A process this harness started: its Popen, role and log files."""

    name: str
    popen: subprocess.Popen[str]
    lines: Lines
    files: list[IO[str]]
    incarnation: Incarnation | None = None
    intended_end: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to this process, by PID, if it has not been reaped yet."""
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def kill(self, timeout: float = 20.0) -> int | None:
        """SIGKILL (SIGCONT first, so a stopped process dies at once) and reap."""
        self.intended_end = True
        self.signal(signal.SIGKILL)
        self.signal(signal.SIGCONT)
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def close_files(self) -> None:
        for f in self.files:
            f.close()


@dataclass
class ClusterSpec:
    """The job: a cluster of ``num_shards`` x ``num_workers`` on ``digits`` (sync by default)."""

    num_shards: int = 2
    num_workers: int = 3
    steps: int = 800
    lease: float = 2.0
    durable_acks: bool = False
    worker_timeout: float = 30.0
    retry_deadline: float = 90.0
    checkpoint_every: int = 1
    slow_ms: float = 0.0
    """Milliseconds every worker sleeps before each push (0: :data:`SLOW_MS`)."""
    data_path: str = "tcp"
    """The workers' ``--data-path``: ``tcp`` (data connections) or ``grpc``."""
    mode: str = "sync"
    """The shards' ``--mode`` (the workers follow it)."""
    lr: float | None = None
    """The workers' ``--lr`` (None: the workload's default, 0.1)."""


class Cluster:
    """Starts, kills, stops and restarts the shards and workers of one job, and reads shard status
    through a long-lived status process inside the shards' namespace (``ip netns exec``).

    Args:
        spec: the job. logs: directory for every process's log. net: where the processes run.
    """

    def __init__(self, spec: ClusterSpec, logs: Path, net: Network) -> None:
        self.spec = spec
        self.logs = logs
        self.net = net
        self.ports = [free_port() for _ in range(spec.num_shards)]
        self.addresses = [f"{net.host}:{p}" for p in self.ports]
        self.shards: list[Process | None] = [None] * spec.num_shards
        self.workers: list[Process | None] = [None] * spec.num_workers
        self.incarnations: list[Incarnation] = []
        self.shard_exits: list[str] = []
        self.status_proc: Process | None = None
        self._counter = 0
        self._last_incarnation = 0
        self._lock = threading.Lock()
        self.origin = time.monotonic()
        self.restarts = [0] * spec.num_workers
        self.closing = False

    # ------------------------------------------------------------------ spawning
    def _spawn(
        self,
        name: str,
        ns: str | None,
        argv: list[str],
        on_line: Callable[[str, float], None] | None = None,
        stdin: bool = False,
    ) -> Process:
        self._counter += 1
        out = (self.logs / f"{name}.{self._counter}.out").open("w")
        err = (self.logs / f"{name}.{self._counter}.log").open("w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        popen = subprocess.Popen(
            [*self.net.prefix(ns), *argv],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            env=env,
        )
        assert popen.stdout is not None
        return Process(name, popen, Lines(popen.stdout, out, on_line), [out, err])

    def start_shard(self, k: int, timeout: float = 90.0) -> float:
        """Start shard ``k`` on its port with its checkpoint directory; returns when it listens.

        Returns:
            The monotonic time it said it listens.

        Raises:
            RuntimeError: it did not listen within ``timeout`` s.
        """
        argv = [PY, "-m", "ps_server.cli", "--mode", self.spec.mode, "--num-workers", str(self.spec.num_workers)]
        argv += ["--num-shards", str(self.spec.num_shards), "--shard-index", str(k), "--host", self.net.host]
        argv += ["--port", str(self.ports[k]), "--metrics-port", "-1", "--lease-timeout", str(self.spec.lease)]
        argv += ["--checkpoint-dir", str(self.logs / f"ckpt-{k}")]
        argv += ["--checkpoint-every", str(self.spec.checkpoint_every)]
        if self.spec.durable_acks:
            argv.append("--durable-acks")
        if self.net.enabled:
            argv.append("--insecure")
        p = self._spawn(f"shard-{k}", self.net.shard_ns, argv)
        self.shards[k] = p
        if p.lines.expect(lambda s: "listening on" in s, timeout) is None:
            raise RuntimeError(f"shard {k} did not listen within {timeout:.0f} s; see {p.files[1].name}")
        return time.monotonic()

    def start_worker(self, r: int) -> Process:
        """Start a new incarnation of rank ``r`` (a higher ``--incarnation`` than any before)."""
        with self._lock:
            inc = max(time.time_ns() // 1000, self._last_incarnation + 1)
            self._last_incarnation = inc
        record = Incarnation(r, inc)
        self.incarnations.append(record)

        def on_line(line: str, now: float) -> None:
            try:
                e = json.loads(line)
            except ValueError:
                return
            if not isinstance(e, dict):
                return
            kind = e.get("event")
            if kind == "start":
                record.start = int(e["step"])
            elif kind == "step":
                record.steps.append(int(e["step"]))
                record.step_times.append(now)
            elif kind == "done":
                record.done = e

        argv = [PY, "-m", "ps_worker.workloads.cli", "--servers", ",".join(self.addresses), "--rank", str(r)]
        argv += ["--num-workers", str(self.spec.num_workers), "--steps", str(self.spec.steps)]
        argv += ["--incarnation", str(inc), "--events", "--json", "--no-progress", "--metrics-port", "-1"]
        argv += ["--retry-deadline", str(self.spec.retry_deadline), "--timeout", str(self.spec.worker_timeout)]
        argv += ["--data-path", self.spec.data_path] + (["--lr", f"{self.spec.lr:g}"] if self.spec.lr else [])
        argv += ["--slow-rank", str(r), "--slow-ms", str(self.spec.slow_ms or SLOW_MS), "--log-level", "INFO", "digits"]
        ns = self.net.worker_ns[r] if self.net.enabled else None
        p = self._spawn(f"worker-{r}", ns, argv, on_line)
        p.incarnation = record
        self.workers[r] = p
        return p

    def start(self) -> None:
        """Shards first (each listening), then every rank."""
        for k in range(self.spec.num_shards):
            self.start_shard(k)
        ns = self.net.shard_ns if self.net.enabled else None
        self.status_proc = self._spawn("status", ns, [PY, "-c", STATUS_SCRIPT, *self.addresses], stdin=True)
        for r in range(self.spec.num_workers):
            self.start_worker(r)

    # ------------------------------------------------------------------ status
    def status(self, timeout: float = 15.0) -> list[dict[str, Any]] | None:
        """Every shard's GetStatus (read from inside the shards' namespace); None on a timeout."""
        p = self.status_proc
        if p is None or not p.alive():
            return None
        assert p.popen.stdin is not None
        try:
            p.popen.stdin.write("s\n")
            p.popen.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        line = p.lines.expect(lambda s: s.startswith("["), timeout)
        return None if line is None else json.loads(line)

    # ------------------------------------------------------------------ supervision
    def reap(self) -> None:
        """Account processes that ended: a worker's exit status; a worker that failed on its own
        (not killed by the test, exit status not 0) is started again, at most
        :data:`SUPERVISOR_RESTARTS` times per rank, and a shard that exited on its own is noted and
        restarted, as a supervisor (Kubernetes) would. Both count as failures (:func:`check_exits`)."""
        for r, w in enumerate(self.workers):
            if w is not None and w.popen.poll() is not None and w.incarnation is not None:
                if w.incarnation.returncode is None:
                    w.incarnation.returncode = w.popen.returncode
                    w.lines.thread.join(timeout=10)
                    w.incarnation.refused = refused_in(Path(w.files[1].name))
                    failed = not w.intended_end and w.popen.returncode != 0
                    if failed and not self.closing and self.restarts[r] < SUPERVISOR_RESTARTS:
                        self.restarts[r] += 1
                        self.start_worker(r)
        for k, s in enumerate(self.shards):
            if s is not None and s.popen.poll() is not None and not s.intended_end:
                self.shard_exits.append(f"shard {k} exited on its own with {s.popen.returncode}")
                s.intended_end = True
                self.start_shard(k)

    def workers_done(self) -> bool:
        """Every rank's current process has ended."""
        self.reap()
        return all(w is None or w.popen.poll() is not None for w in self.workers)

    def finals(self) -> list[Incarnation]:
        """The last incarnation of every rank."""
        return [
            max((i for i in self.incarnations if i.rank == r), key=lambda i: i.incarnation)
            for r in range(self.spec.num_workers)
        ]

    def last_step_time(self) -> float:
        """Monotonic time of the newest step event of any rank (the start when none yet)."""
        return max((i.step_times[-1] for i in self.incarnations if i.step_times), default=self.origin)

    def last_step(self) -> int:
        """The highest step printed by any rank so far."""
        return max((i.last_step or 0 for i in self.incarnations), default=0)

    def close(self) -> None:
        """SIGTERM the shards (a final checkpoint), kill whatever still runs, by PID; close logs."""
        self.closing = True
        procs = [p for p in [*self.workers, *self.shards, self.status_proc] if p is not None]
        for p in procs:
            p.intended_end = True
            p.signal(signal.SIGCONT)
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill(timeout=10)
        for p in procs:
            p.lines.thread.join(timeout=5)
            p.close_files()
        self.reap()


def refused_in(log: Path) -> int:
    """Pushes a worker logged as refused (``--log-level INFO``)."""
    try:
        return log.read_text(errors="replace").count("push refused as too stale")
    except OSError:
        return 0


# ============================================================================ faults
@dataclass
class Fault:
    """One fault the injector made: what, to whom, when (seconds since the job's start), how long."""

    kind: str
    target: str
    at: float
    seconds: float
    note: str = ""

    def __str__(self) -> str:
        return f"t={self.at:6.1f} s  {self.kind:<12} {self.target:<8} {self.seconds:5.1f} s  {self.note}"


KINDS = ("kill_worker", "kill_shard", "stop_worker", "stop_shard", "partition")


@dataclass
class Budget:
    """How many faults of each kind at most, and the time bounds of each."""

    max_each: int = 4
    pause: tuple[float, float] = (2.0, 6.0)
    recover_timeout: float = 60.0


class FaultInjector:
    """Injects random faults into ``cluster`` until ``deadline`` (or ``stop_when()``), one at a time:
    each fault ends (process restarted, continued, link restored) before the next starts, then the
    injector waits until every rank with a running process made a step again (at most
    ``budget.recover_timeout`` s) and pauses a random while.

    Args:
        cluster: the running job. rng: the seeded source of every choice. budget: bounds.
    """

    def __init__(self, cluster: Cluster, rng: random.Random, budget: Budget | None = None) -> None:
        self.cluster = cluster
        self.rng = rng
        self.budget = budget or Budget()
        self.faults: list[Fault] = []
        self.holds: list[Hold] = []
        self.unrecovered: list[str] = []
        kinds = [k for k in KINDS if k != "partition" or cluster.net.enabled]
        self.kinds = kinds
        # every kind once first (shuffled), then any kind, within max_each
        first = list(kinds)
        rng.shuffle(first)
        self.plan = first

    def now(self) -> float:
        return time.monotonic() - self.cluster.origin

    def _sleep(self, seconds: float) -> None:
        """Sleep (spacing random faults, or holding one), supervising the processes meanwhile."""
        end = time.monotonic() + seconds
        while True:
            self.cluster.reap()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.2, left))

    def _next_kind(self) -> str | None:
        if self.plan:
            return self.plan.pop(0)
        counts = {k: sum(f.kind == k for f in self.faults) for k in self.kinds}
        left = [k for k in self.kinds if counts[k] < self.budget.max_each]
        return self.rng.choice(left) if left else None

    def run(self, deadline: float, stop_when: Callable[[], bool]) -> None:
        """Inject until the monotonic ``deadline`` or ``stop_when()``."""
        while time.monotonic() < deadline and not stop_when():
            self._sleep(self.rng.uniform(*self.budget.pause))
            if time.monotonic() >= deadline or stop_when():
                return
            kind = self._next_kind()
            if kind is None:
                return
            getattr(self, kind)()
            if not self._recovered(self.budget.recover_timeout):
                self.unrecovered.append(f"after {self.faults[-1]}")
                return  # a wedged job: stop injecting; the invariants report it

    def _recovered(self, timeout: float) -> bool:
        """Every rank whose process runs made a step after now (or finished), within ``timeout``."""
        mark = time.monotonic()
        deadline = mark + timeout
        while time.monotonic() < deadline:
            self.cluster.reap()
            ok = True
            for w in self.cluster.workers:
                if w is None or w.incarnation is None or not w.alive():
                    continue
                times = w.incarnation.step_times
                if not times or times[-1] < mark:
                    ok = False
            if ok:
                return True
            time.sleep(0.2)
        return False

    def _duration(self) -> float:
        """A hold time shorter or longer than the lease, at random."""
        lease = self.cluster.spec.lease
        return self.rng.choice([self.rng.uniform(0.3, 0.8) * lease, self.rng.uniform(1.5, 3.0) * lease])

    def kill_worker(self) -> None:
        """kill -9 a rank's process; start a new incarnation at once or once the shards evicted it."""
        c = self.cluster
        r = self.rng.randrange(c.spec.num_workers)
        w = c.workers[r]
        if w is None or not w.alive():
            return
        at = self.now()
        assert w.incarnation is not None
        w.incarnation.killed = True
        w.kill()
        c.reap()
        wait_eviction = self.rng.random() < 0.5
        note = "restarted at once"
        if wait_eviction:
            ok = poll(lambda: evicted(c.status(), r), 3 * c.spec.lease + 10)
            note = "restarted after its eviction" if ok else "restarted (eviction not seen in time)"
        c.start_worker(r)
        self.faults.append(Fault("kill_worker", f"rank {r}", at, self.now() - at, note))

    def kill_shard(self) -> None:
        """kill -9 a shard; start it again on the same port with the same checkpoint directory."""
        c = self.cluster
        k = self.rng.randrange(c.spec.num_shards)
        s = c.shards[k]
        if s is None:
            return
        start = time.monotonic()
        at = self.now()
        s.kill()
        listening = c.start_shard(k)
        self.holds.append(Hold(f"shard {k} down", start, listening))
        st = c.status()
        restored = None if st is None or "error" in st[k] else st[k].get("restored_from")
        self.faults.append(Fault("kill_shard", f"shard {k}", at, self.now() - at, f"resumed from version {restored}"))

    def stop_worker(self) -> None:
        """SIGSTOP a rank's process for a while shorter or longer than the lease, then SIGCONT."""
        c = self.cluster
        r = self.rng.randrange(c.spec.num_workers)
        w = c.workers[r]
        if w is None or not w.alive():
            return
        seconds, at = self._duration(), self.now()
        w.signal(signal.SIGSTOP)
        try:
            self._sleep(seconds)
        finally:
            w.signal(signal.SIGCONT)
        self.faults.append(Fault("stop_worker", f"rank {r}", at, seconds))

    def stop_shard(self) -> None:
        """SIGSTOP a shard for a while shorter or longer than the lease, then SIGCONT."""
        c = self.cluster
        k = self.rng.randrange(c.spec.num_shards)
        s = c.shards[k]
        if s is None or not s.alive():
            return
        seconds, at, start = self._duration(), self.now(), time.monotonic()
        s.signal(signal.SIGSTOP)
        try:
            self._sleep(seconds)
        finally:
            s.signal(signal.SIGCONT)
        self.holds.append(Hold(f"shard {k} stopped", start, time.monotonic()))
        self.faults.append(Fault("stop_shard", f"shard {k}", at, seconds))

    def partition(self) -> None:
        """Cut one rank's link to the shards for a while, then restore it."""
        c = self.cluster
        r = self.rng.randrange(c.spec.num_workers)
        lease = c.spec.lease
        seconds = self.rng.choice([self.rng.uniform(0.3, 0.8) * lease, self.rng.uniform(1.5, 3.0) * lease])
        at = self.now()
        c.net.cut(r)
        try:
            self._sleep(seconds)
        finally:
            c.net.restore(r)
        self.faults.append(Fault("partition", f"rank {r}", at, seconds))


def evicted(status: list[dict[str, Any]] | None, rank: int, shards: list[int] | None = None) -> bool:
    """Every shard (or each of ``shards``) reports rank ``rank`` evicted."""
    if not status:
        return False
    try:
        return all(status[k]["workers"][rank]["state"] == "WORKER_STATE_EVICTED" for k in shards or range(len(status)))
    except (KeyError, IndexError):
        return False


def poll(check: Callable[[], bool], timeout: float, every: float = 0.3) -> bool:
    """``check()`` until true or ``timeout`` s passed (polling with a deadline)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every)
    return False


def report(
    seed: int,
    spec: ClusterSpec,
    net: Network,
    window: float,
    faults: Sequence[Fault],
    findings: Sequence[Finding],
    counts: Sequence[PushCount],
    final_status: list[dict[str, Any]] | None,
    unrecovered: Sequence[str],
) -> str:
    """The soak's report: seed, set-up, faults with times, findings, push counts."""
    lines = [
        f"chaos soak: seed {seed} (PS_SOAK_SEED={seed} reproduces the fault sequence)",
        f"  job: {spec.mode}, {spec.num_shards} shards x {spec.num_workers} workers, digits, {spec.steps} steps, "
        f"lease {spec.lease:g} s, checkpoint every {spec.checkpoint_every} versions, durable acks "
        + ("on" if spec.durable_acks else "off (a killed shard loses rounds: the ranks push them again)"),
        "  network: " + (f"namespaces {net.tag}*" if net.enabled else f"127.0.0.1 ({net.why_not}; no partitions)"),
        f"  fault window: {window:.0f} s, {len(faults)} faults:",
        *(f"    {f}" for f in faults),
    ]
    if unrecovered:
        lines.append(f"  NOT RECOVERED: {'; '.join(unrecovered)}")
    if final_status:
        for s in final_status:
            if "error" in s:
                lines.append(f"  shard {s['address']}: {s['error']}")
            else:
                lines.append(
                    f"  shard {s['address']}: version {s['version']}, restored_from {s['restored_from']}, pushes "
                    + str([w["pushes"] for w in s["workers"]])
                )
    lines += [f"  {f}" for f in findings]
    return "\n".join(lines)
