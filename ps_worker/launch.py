"""``ps-launch``: the embedded default. Shards and workers as local processes on 127.0.0.1.

Starts S ``ps-server`` processes on free ports, then W ``ps-worker`` processes; shows live
progress (tqdm, one bar per rank, on stderr); prints a final summary on stdout (``--json``: one
JSON object on the last line). Exits non-zero when any process fails and never leaves a process
behind: children are ended on exit, errors and Ctrl-C, and get SIGTERM if the launcher is killed.
Children start with ``GLIBC_TUNABLES`` and ``OMP_NUM_THREADS`` set (see :func:`launch_environment`)
unless the user set them.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
from tqdm import tqdm

from ps_common import jsonout
from ps_common.flags import FlagParser, join_timeout_flag, mode_flags, secret
from ps_common.modes import MODES
from ps_common.process_env import GLIBC_TUNABLES, available_cpus, launch_environment
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_worker.faults import Fault, parse_faults
from ps_worker.flags import CommandParser, training_flags, workload_argument

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


def launch_parser(environ: Mapping[str, str] | None = None) -> FlagParser:
    """The ``ps-launch`` flags (DESIGN section 10)."""
    p = CommandParser(
        prog="ps-launch",
        description="Run a grpc-ps cluster and a training job on this machine.",
        epilog=(
            f"Every shard and worker starts with GLIBC_TUNABLES={GLIBC_TUNABLES} (malloc tuned for large "
            "messages) and OMP_NUM_THREADS=max(1, CPUs // (shards + workers)) unless you set them: a value in "
            "ps-launch's environment wins (an empty GLIBC_TUNABLES turns the tuning off)."
        ),
        environ=environ,
    )
    p.flag("--shards", type=int, default=2, help="number of shard processes")
    p.flag("--workers", type=int, default=2, help="number of worker processes")
    p.flag("--mode", default="sync", choices=MODES, help="consistency model")
    mode_flags(p)
    training_flags(p)
    p.flag("--timeout", type=float, default=60.0, help="per-RPC deadline of workers, seconds")
    p.flag("--log-dir", default="", help="directory for each process's log (default: a temporary directory)")
    p.flag("--no-metrics", switch=True, help="serve no Prometheus /metrics from shards and workers")
    p.flag("--json", switch=True, help="print the summary as one JSON object on the last line of stdout")
    p.flag("--no-progress", switch=True, help="no progress bars")
    p.flag("--lease-timeout", type=float, default=10.0, help="seconds of silence before a shard evicts a rank")
    join_timeout_flag(p)
    p.flag(
        "--checkpoint-every",
        type=int,
        default=50,
        help="shards checkpoint every V versions into LOG_DIR/checkpoints (0: only when they stop)",
    )
    p.flag(
        "--fault",
        default="",
        help="inject faults: kill-worker:R@step=N[,restart] or kill-shard:K@step=N[,restart], ';'-separated",
    )
    workload_argument(p)
    return p


@dataclass
class Child:
    """One started process and where its output goes."""

    name: str
    proc: subprocess.Popen[str]
    log_path: Path
    log_file: IO[str]
    argv: list[str] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    metrics_url: str | None = None


class Cluster:
    """Local shard and worker processes; :meth:`stop` ends every one of them.

    Args:
        log_dir: where each process's log goes.
        env: the environment of every process (``PYTHONUNBUFFERED=1`` is added).
    """

    def __init__(self, log_dir: Path, env: Mapping[str, str]) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []
        self.env = {**env, "PYTHONUNBUFFERED": "1"}

    def spawn(self, name: str, argv: Sequence[str]) -> Child:
        log_path = self.log_dir / f"{name}.log"
        log_file = open(log_path, "a")  # noqa: SIM115 - closed in stop(); appended to on a restart
        # Ctrl-C between fork and registration would leave a child nobody stops: hold it until then.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", *argv],
                stdout=subprocess.PIPE,
                stderr=log_file,
                text=True,
                env=self.env,
                preexec_fn=_die_with_parent,
                start_new_session=True,
            )
            child = Child(name, proc, log_path, log_file, argv=list(argv))
            self.children.append(child)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        print(f"ps-launch: started {name} (pid {proc.pid})", file=sys.stderr, flush=True)
        return child

    def start_shards(
        self,
        n: int,
        workers: int,
        mode: str,
        extra: Sequence[str] = (),
        deadline: float = 60.0,
        metrics: bool = True,
    ) -> list[str]:
        """Start ``n`` shards on free ports (``extra``: more ps-server flags; ``/metrics`` too, unless
        ``metrics`` is False); returns their addresses in shard order.

        Raises:
            RuntimeError: a shard exited or did not report its port in time.
        """
        shards = [
            self.spawn(
                f"shard-{k}",
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
                    "0",
                    "--metrics-port",
                    "0" if metrics else "-1",
                    *extra,
                ],
            )
            for k in range(n)
        ]
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
            addresses[k] = addr
        return [addresses[k] for k in range(n)]

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


def server_flags(args: Any, log_dir: Path) -> list[str]:
    """The mode and checkpoint parameters ps-launch forwards to every ps-server."""
    flags = [
        "--checkpoint-dir",
        str(log_dir / "checkpoints"),
        "--checkpoint-every",
        str(args.checkpoint_every),
        "--lease-timeout",
        str(args.lease_timeout),
        "--join-timeout",
        str(args.join_timeout),
        "--sync-quorum",
        str(args.sync_quorum),
        "--round-timeout",
        str(args.round_timeout),
        "--max-staleness",
        str(args.max_staleness),
        "--staleness-lr",
        args.staleness_lr,
        "--staleness",
        str(args.staleness),
        "--communication-period",
        str(args.communication_period),
    ]
    if args.moving_rate is not None:
        flags += ["--moving-rate", str(args.moving_rate)]
    if args.easgd_sync:
        flags.append("--easgd-sync")
    return flags


def shard_statuses(addresses: Sequence[str], timeout: float = 10.0) -> list[ps_pb2.ShardStatus]:
    """Admin/GetStatus of every shard (the shards' own account of clocks and refusals), with the admin
    token the shards took from this environment (``PS_ADMIN_TOKEN`` or ``PS_ADMIN_TOKEN_FILE``), if any."""
    try:
        token = secret(os.environ.get("PS_ADMIN_TOKEN", ""), os.environ.get("PS_ADMIN_TOKEN_FILE", ""), "--admin-token")
    except ValueError:
        token = ""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    statuses = []
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            stub = ps_pb2_grpc.AdminStub(channel)
            statuses.append(stub.GetStatus(ps_pb2.GetStatusRequest(), timeout=timeout, metadata=metadata).status)
    return statuses


def finished_version(statuses: Sequence[ps_pb2.ShardStatus], steps: int) -> int | None:
    """The version at which the job whose checkpoints every shard resumed from had already run
    ``steps`` steps on every rank (so workers would train nothing); None for a fresh start or a job
    with steps left. The steps a rank has done are those its worker resumes at (``train``): sync, the
    round (version); async and ssp, the rank's clock; easgd, its exchanges times the period.
    """
    if not statuses or not all(st.HasField("restored_from_version") for st in statuses):
        return None
    version = min(st.version for st in statuses)
    config = statuses[0].config
    if config.mode == ps_pb2.MODE_SYNC:
        return version if version >= steps else None
    done = [max(st.workers[r].clock for st in statuses) for r in range(len(statuses[0].workers))]
    if config.mode == ps_pb2.MODE_EASGD:
        period = max(1, config.communication_period)
        done = [clock * period for clock in done]
        steps -= steps % period  # the steps after the last whole period end no exchange
    return version if all(d >= steps for d in done) else None


class MembershipWatch:
    """Polls one shard's status and says when a rank's state or incarnation changes (an eviction, a
    rejoin), so a fault injection shows its consequences on the console."""

    def __init__(self, address: str, interval: float = 0.5) -> None:
        self.address = address
        self.interval = interval
        self.seen: dict[int, tuple[int, int]] = {}
        self.next = 0.0

    def changes(self) -> list[str]:
        now = time.monotonic()
        if now < self.next:
            return []
        self.next = now + self.interval
        try:
            (status,) = shard_statuses([self.address], timeout=2.0)
        except grpc.RpcError:
            return []
        lines = []
        for w in status.workers:
            before = self.seen.get(w.rank)
            self.seen[w.rank] = (w.state, w.incarnation)
            if before is None or before == (w.state, w.incarnation) or before[0] == ps_pb2.WORKER_STATE_PENDING:
                continue  # nothing new, or a first join
            state = ps_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower()
            if w.state == ps_pb2.WORKER_STATE_EVICTED:
                lines.append(
                    f"shard-0 evicted rank {w.rank} at clock {w.clock} (its lease lapsed); rounds go on without it"
                )
            elif w.incarnation != before[1] and w.state == ps_pb2.WORKER_STATE_LIVE:
                lines.append(f"shard-0 counts rank {w.rank} again (new incarnation {w.incarnation}, clock {w.clock})")
            elif w.state != ps_pb2.WORKER_STATE_LEFT:
                lines.append(f"rank {w.rank} is {state} on shard-0 (clock {w.clock})")
        return lines


def close_bars(bars: Sequence[tqdm]) -> None:
    """Close the progress bars (last first, so each clears its own line) and leave the cursor at the
    start of a clean line, so what follows is not printed in the middle of a bar's old line."""
    shown = [b for b in bars if not b.disable]
    for b in reversed(bars):
        b.close()
    if shown:
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()


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


@dataclass
class RankRun:
    """What one process of a rank did, as ps-launch saw it from its events."""

    first: int
    """Step it started at (a restarted rank resumes at the cluster's clock)."""
    last: int
    """Last step it reported."""
    report: dict[str, Any] | None = None
    """Its final report (None: killed before the end)."""
    started: float = 0.0
    """``time.perf_counter()`` of its first step."""

    @property
    def steps(self) -> int:
        return max(0, (self.report["steps"] if self.report else self.last) - self.first)


def _finite(x: Any) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def mean(values: Sequence[float | None]) -> float | None:
    """Mean of the values that are numbers; None when there are none (a rank that trained no step)."""
    known = [v for v in values if v is not None and math.isfinite(v)]
    return sum(known) / len(known) if known else None


def summarize(
    args: Any,
    done: list[dict[str, Any]],
    wall: float,
    addresses: list[str],
    statuses: Sequence[ps_pb2.ShardStatus] = (),
    metrics_urls: Mapping[str, str] | None = None,
    runs: Mapping[int, Sequence[RankRun]] | None = None,
    train_seconds: float | None = None,
) -> dict[str, Any]:
    """The run's summary from what each rank actually did: every worker's final report, the steps
    each of its processes ran (``runs``: rank -> its processes, restarts included) and the shards'
    status. ``metrics_urls`` maps process name (``shard-0``, ``worker-1``) to its ``/metrics`` URL.
    Throughput is steps run (all ranks, all processes) over ``train_seconds`` (first step of any
    rank to the last step of all; start-up excluded), and samples are those steps times the batch."""
    done = sorted(done, key=lambda d: d["rank"])
    runs = runs or {d["rank"]: [RankRun(d.get("first_step", 0), d["steps"], d)] for d in done}
    rejected: dict[str, int] = {}
    for st in statuses:
        for reason, n in st.rejected_pushes.items():
            rejected[reason] = max(rejected.get(reason, 0), n)
    first_status = statuses[0] if statuses else None
    shard_view = {
        "clocks": [w.clock for w in first_status.workers] if first_status else [],
        "pushes": [w.pushes for w in first_status.workers] if first_status else [],
        "worker_states": [
            ps_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower() for w in first_status.workers
        ]
        if first_status
        else [],
        "incarnations": [w.incarnation for w in first_status.workers] if first_status else [],
        "restored_from": [
            st.restored_from_version if st.HasField("restored_from_version") else None for st in statuses
        ],
        "last_checkpoint": [
            st.last_checkpoint_version if st.HasField("last_checkpoint_version") else None for st in statuses
        ],
        "max_clock_gap": max((st.max_clock_gap for st in statuses), default=0),
        "rejected_pushes": rejected,
        "staleness_p50": max((st.staleness.p50 for st in statuses), default=0.0),
        "staleness_p90": max((st.staleness.p90 for st in statuses), default=0.0),
        "staleness_p99": max((st.staleness.p99 for st in statuses), default=0.0),
        "staleness_max": max((st.staleness.max for st in statuses), default=0),
        "received_bytes": sum(st.received_bytes for st in statuses),
        "sent_bytes": sum(st.sent_bytes for st in statuses),
    }
    ranks = []
    for r in range(args.workers):
        mine = list(runs.get(r, ()))
        steps = sum(run.steps for run in mine)
        report = next((run.report for run in reversed(mine) if run.report), None)
        ranks.append(
            {
                "rank": r,
                "steps_run": steps,
                "samples": steps * args.batch_size,
                "restarts": max(0, len(mine) - 1),
                "resumed_at": [run.first for run in mine[1:]],
                "finished": report is not None,
                "final_loss": _finite(report["final_loss"]) if report else None,
            }
        )
    total_steps = sum(r["steps_run"] for r in ranks)
    partial = bool(statuses) and any(r["restarts"] or not r["finished"] for r in ranks)
    seconds = train_seconds if train_seconds else max((d["wall_seconds"] for d in done), default=0.0)
    rate = total_steps / seconds if seconds > 0 else 0.0
    first_done = done[0] if done else {}
    return {
        "workload": args.workload,
        "mode": args.mode,
        "shards": args.shards,
        "workers": args.workers,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "final_loss": mean([r["final_loss"] for r in ranks]),
        "accuracy": first_done.get("accuracy"),
        "eval_loss": _finite(first_done.get("eval_loss")),
        "bits_per_char": first_done.get("bits_per_char"),
        "accuracy_per_rank": [d["accuracy"] for d in done],
        "wall_seconds": wall,
        "train_seconds": seconds,
        "steps_per_second": rate,
        "samples_per_second": rate * args.batch_size,
        "steps_run_per_rank": [r["steps_run"] for r in ranks],
        "ranks": ranks,
        # a killed process never reports its bytes: then the shards' count (every process's) is the truth
        "pushed_bytes": shard_view["received_bytes"] if partial else sum(d["pushed_bytes"] for d in done),
        "pulled_bytes": shard_view["sent_bytes"] if partial else sum(d["pulled_bytes"] for d in done),
        "version": first_done.get("version"),
        "params_sha256": first_done.get("params_sha256"),
        "params_sha256_per_rank": [d["params_sha256"] for d in done],
        "servers": addresses,
        "refused_pushes": sum(d.get("refused_pushes", 0) for d in done),
        "dropped_pushes": sum(d.get("dropped_pushes", 0) for d in done),
        "shards_view": shard_view,
        "metrics_urls": dict(metrics_urls or {}),
    }


def nothing_to_do(args: Any, log_dir: Path, version: int, out: IO[str]) -> None:
    """Say that the job in ``log_dir`` already ran ``--steps`` (``--json``: as one JSON object too)."""
    print(
        f"ps-launch: nothing to do: the job in {log_dir} finished at version {version} (every rank has run "
        f"--steps {args.steps}); use a new --log-dir or raise --steps",
        file=out,
    )
    if args.json:
        summary = {"nothing_to_do": True, "log_dir": str(log_dir), "version": version, "steps": args.steps}
        print(jsonout.dumps({"workload": args.workload, "mode": args.mode, **summary}), file=out, flush=True)


STALENESS_UNIT = {
    "sync": "sync: every gradient is applied to the version it was computed on",
    "async": "versions behind when applied (--max-staleness bounds it)",
    "ssp": "versions behind when applied; the bound s counts clocks (see the gap above)",
    "easgd": "not measured (workers exchange parameters)",
}


def _restart_note(ranks: Sequence[dict[str, Any]]) -> str:
    notes = [
        f"rank {r['rank']} restarted {r['restarts']}x, resumed at step {', '.join(map(str, r['resumed_at']))}"
        for r in ranks
        if r["restarts"]
    ]
    notes += [f"rank {r['rank']} did not finish" for r in ranks if not r["finished"]]
    return f" ({'; '.join(notes)})" if notes else ""


def print_summary(s: dict[str, Any], out: IO[str]) -> None:
    mib = 1024 * 1024
    view = s["shards_view"]
    loss = s["final_loss"]
    rows = [
        ("workload", f"{s['workload']} ({s['mode']}, {s['shards']} shards x {s['workers']} workers)"),
        ("steps per worker", f"{s['steps']} (batch {s['batch_size']})"),
        ("steps run per rank", f"{s['steps_run_per_rank']}{_restart_note(s['ranks'])}"),
        (
            "final loss",
            "-" if loss is None else f"{loss:.4f} (mean of the last 10 steps of each rank that finished)",
        ),
        ("held-out accuracy", "-" if s["accuracy"] is None else f"{s['accuracy']:.4f}"),
        ("held-out loss", "-" if s["eval_loss"] is None else f"{s['eval_loss']:.3g}"),
    ]
    if s.get("bits_per_char") is not None:
        rows.append(("bits per char", f"{s['bits_per_char']:.3f} (held out)"))
    rows += [
        ("wall time", f"{s['wall_seconds']:.1f} s (training {s['train_seconds']:.1f} s)"),
        ("throughput", f"{s['steps_per_second']:.1f} steps/s, {s['samples_per_second']:.0f} samples/s (all ranks)"),
        ("bytes moved", f"pushed {s['pushed_bytes'] / mib:.1f} MiB, pulled {s['pulled_bytes'] / mib:.1f} MiB"),
        ("final version", str(s["version"])),
        ("clocks per rank", f"{view['clocks']} (largest gap at a read: {view['max_clock_gap']})"),
        (
            "staleness",
            f"0 ({STALENESS_UNIT['sync']})"
            if s["mode"] == "sync"
            else "p50 {staleness_p50:g}, p90 {staleness_p90:g}, p99 {staleness_p99:g}, max {staleness_max}".format(
                **view
            )
            + f" ({STALENESS_UNIT.get(s['mode'], 'versions behind')})",
        ),
        ("refused / dropped", f"{s['refused_pushes']} refused as too stale, {s['dropped_pushes']} dropped late"),
        ("params sha256", s["params_sha256"]),
    ]
    width = max(len(k) for k, _ in rows)
    print("grpc-ps run summary", file=out)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}", file=out)
    out.flush()


def run(args: Any) -> int:
    """Start the cluster, watch the workers, summarize. Returns the exit status."""
    if args.shards < 1 or args.workers < 1 or args.steps < 1:
        print("ps-launch: --shards, --workers and --steps must be >= 1.", file=sys.stderr)
        return 2
    try:
        faults = parse_faults(args.fault, args.shards, args.workers)
    except ValueError as exc:
        print(f"ps-launch: {exc}", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="ps-launch-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(log_dir, launch_environment(os.environ, args.shards + args.workers, available_cpus()))
    print(
        f"ps-launch: children run with OMP_NUM_THREADS={cluster.env['OMP_NUM_THREADS']} "
        f"GLIBC_TUNABLES={cluster.env['GLIBC_TUNABLES']}",
        file=sys.stderr,
    )
    bars: list[tqdm] = []
    failed = False
    started = time.perf_counter()
    try:
        addresses = cluster.start_shards(
            args.shards, args.workers, args.mode, server_flags(args, log_dir), metrics=not args.no_metrics
        )
        where = f"logs in {log_dir}" + (
            "" if args.log_dir else " (removed at the end unless the run fails; --log-dir keeps them)"
        )
        print(f"ps-launch: {args.shards} shards on {', '.join(addresses)}; {where}", file=sys.stderr)
        for c in cluster.children:
            if c.metrics_url:
                print(f"ps-launch: {c.name} metrics on {c.metrics_url}", file=sys.stderr)
        finished = finished_version(shard_statuses(addresses), args.steps)
        if finished is not None:  # a finished job run again: say so, rather than train nothing
            nothing_to_do(args, log_dir, finished, sys.stdout)
            return 0
        events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        workers = []
        fired: list[dict[str, Any]] = []
        restarts: list[str] = []
        for r in range(args.workers):
            argv = [
                "ps_worker.cli",
                "--servers",
                ",".join(addresses),
                "--rank",
                str(r),
                "--num-workers",
                str(args.workers),
                "--steps",
                str(args.steps),
                "--batch-size",
                str(args.batch_size),
                "--optimizer",
                args.optimizer,
                "--lr",
                str(args.lr),
                "--momentum",
                str(args.momentum),
                "--seed",
                str(args.seed),
                "--timeout",
                str(args.timeout),
                "--slow-rank",
                str(args.slow_rank),
                "--slow-ms",
                str(args.slow_ms),
                "--wire-dtype",
                args.wire_dtype,
                "--topk",
                str(args.topk),
                *(["--overlap"] if args.overlap else []),
                "--metrics-port",
                "-1" if args.no_metrics else "0",
                "--events",
                args.workload,
            ]
            if args.corpus:
                argv[-1:-1] = ["--corpus", str(Path(args.corpus).resolve())]
            child = cluster.spawn(f"worker-{r}", argv)
            workers.append(child)
            threading.Thread(target=read_events, args=(child, events), daemon=True).start()
        bars = [
            tqdm(
                total=args.steps,
                desc=f"rank {r}",
                position=r,
                unit="step",
                file=sys.stderr,
                disable=args.no_progress or None,
                dynamic_ncols=True,
                leave=False,
            )
            for r in range(args.workers)
        ]
        done: dict[str, dict[str, Any]] = {}
        exited: set[str] = set()
        killed: dict[str, Fault] = {}
        # a killed worker with `,restart` starts again once the shards evicted it (or after three leases),
        # so the console shows the kill, the eviction and the rejoin in that order: worker name -> deadline
        respawn: dict[str, float] = {}
        shards = [c for c in cluster.children if c.name.startswith("shard-")]
        runs: dict[int, list[RankRun]] = {r: [] for r in range(args.workers)}
        first_step: float | None = None
        last_step = 0.0
        watch = MembershipWatch(addresses[0]) if faults else None

        def inject(fault: Fault, step: int) -> None:
            tqdm.write(f"ps-launch: fault {fault} at step {step}", file=sys.stderr)
            fired.append({"fault": str(fault), "step": step, "seconds": time.perf_counter() - started})
            if fault.what == "worker":
                killed[fault.name] = fault
                workers[fault.index].proc.kill()
                return
            victim = shards[fault.index]
            victim.proc.kill()
            victim.proc.wait(timeout=30)
            if fault.restart:
                shards[fault.index] = cluster.restart_shard(victim, addresses[fault.index])
                tqdm.write(f"ps-launch: {fault.name} restarted (pid {shards[fault.index].proc.pid})", file=sys.stderr)

        while len(exited) < len(workers):
            if watch is not None:
                for line in watch.changes():
                    tqdm.write(f"ps-launch: {line}", file=sys.stderr)
            for name in list(respawn):
                evicted = watch is not None and watch.seen.get(int(name.split("-")[1]), (0,))[0] == (
                    ps_pb2.WORKER_STATE_EVICTED
                )
                if evicted or time.monotonic() > respawn[name]:
                    del respawn[name]
                    rank = int(name.split("-")[1])
                    workers[rank] = cluster.spawn(name, workers[rank].argv)
                    threading.Thread(target=read_events, args=(workers[rank], events), daemon=True).start()
                    restarts.append(name)
            try:
                name, event = events.get(timeout=0.5)
            except queue.Empty:
                continue
            rank = int(name.split("-")[1])
            if event.get("event") == "start":
                now = time.perf_counter()
                first_step = now if first_step is None else first_step
                runs[rank].append(RankRun(event["step"], event["step"], started=now))
                bars[rank].reset(total=args.steps)  # the rate counts from here: start-up is not training
                bars[rank].update(event["step"])
                if len(runs[rank]) > 1:
                    tqdm.write(f"ps-launch: {name} rejoined; resumes at step {event['step']}", file=sys.stderr)
            elif event.get("event") == "step":
                last_step = time.perf_counter()
                if runs[rank]:
                    runs[rank][-1].last = event["step"]
                bars[rank].update(event["step"] - bars[rank].n)
                bars[rank].set_postfix(loss=f"{event['loss']:.4f}", refresh=False)
                for fault in [f for f in faults if f.due(rank, event["step"])]:
                    faults.remove(fault)
                    inject(fault, event["step"])
            elif event.get("event") == "metrics":
                workers[rank].metrics_url = event["url"]
                tqdm.write(f"ps-launch: {name} metrics on {event['url']}", file=sys.stderr)
            elif event.get("event") == "done":
                done[name] = event
                if runs[rank]:
                    runs[rank][-1].report = event
            elif event.get("event") == "exit" and name in killed:
                fault = killed.pop(name)
                workers[rank].proc.wait(timeout=30)
                steps = runs[rank][-1].last if runs[rank] else 0
                tqdm.write(f"ps-launch: {name} killed at step {steps} (pid {workers[rank].proc.pid})", file=sys.stderr)
                if not fault.restart:
                    exited.add(name)  # an injected death, not a failure of the run
                    continue
                respawn[name] = time.monotonic() + 3 * args.lease_timeout
            elif event.get("event") == "exit":
                exited.add(name)
                code = workers[rank].proc.wait(timeout=30)
                if code != 0 or name not in done:
                    raise RuntimeError(f"{name} failed (exit {code}):\n{tail(workers[rank].log_path)}")
        wall = time.perf_counter() - started
        train_seconds = last_step - first_step if first_step is not None else None
        statuses = shard_statuses(addresses)
    except (RuntimeError, grpc.RpcError) as exc:
        failed = True
        close_bars(bars)
        what = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else str(exc)
        print(f"ps-launch: {what}\nlogs in {log_dir}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nps-launch: interrupted; stopping every process", file=sys.stderr)
        return 130
    finally:
        cluster.stop()
        if not args.log_dir and not failed:  # a temporary directory: logs and checkpoints of a finished run
            shutil.rmtree(log_dir, ignore_errors=True)
    close_bars(bars)
    metrics_urls = {c.name: c.metrics_url for c in cluster.children if c.metrics_url}
    summary = summarize(
        args, list(done.values()), wall, addresses, statuses, metrics_urls, runs=runs, train_seconds=train_seconds
    )
    summary["faults"] = fired
    summary["restarted"] = restarts
    print_summary(summary, sys.stdout)
    if args.json:
        print(jsonout.dumps(summary), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    args = launch_parser().parse_args(argv)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # Installed explicitly: a launcher started from a script may inherit SIGINT as ignored.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
