"""grpc-ps benchmark: push+pull against the machine's limits and against the peers, alternating in one run.

    python bench/run.py [--quick] [--json out.json]

For each payload size every system is set up once, then measured in rounds, A B C ... A B C ...,
so that load from other processes on the machine falls on all of them alike. Each round of a
system runs a few untimed warm-up steps, then times single steps. The table gives the median
over all timed steps, min-max, and the ratios the performance issue targets; the JSON keeps every
sample. Every measured process is a child started here, with the same environment (glibc malloc
tunables, one intra-op thread) and is killed by its pid at the end. See bench/README.md.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    BENCH,
    GLIBC_TUNABLES,
    Child,
    ChildError,
    ask_all,
    child_env,
    cpu_seconds,
    describe,
    free_port,
    shard_argv,
)

from ps_common import jsonout

PY = sys.executable
STARTUP_TIMEOUT = 300.0
SETUP_TIMEOUT = 300.0
STEP_TIMEOUT = 60.0
"""Seconds one timed step may take before the run is declared hung."""


@dataclass(frozen=True)
class Size:
    """A payload: ``nbytes`` of float32 (``model="digits"``: the digits MLP for grpc-ps)."""

    label: str
    nbytes: int
    warmup: int
    iters: int
    model: str = "flat"


DIGITS_BYTES = (64 * 128 + 128 + 128 * 10 + 10) * 4  # 38,952 B
SIZES = {
    "small": Size("small", DIGITS_BYTES, warmup=20, iters=200, model="digits"),
    "4": Size("4MB", 4_000_000, warmup=3, iters=10),
    "25": Size("25MB", 25_000_000, warmup=1, iters=4),
    "100": Size("100MB", 100_000_000, warmup=1, iters=3),
}
QUICK_SIZE = Size("4MB", 4_000_000, warmup=2, iters=5)
FAMILIES = ("memcpy", "tcp", "gloo", "rpc", "grpc-ps")
GRID = ((1, 1), (1, 2), (2, 1), (2, 2))
"""grpc-ps (workers, shards) measured at each size of a flat model."""


class System:
    """A measured configuration: its processes, set up per size, asked to run steps.

    ``drivers`` time the steps (the first one's samples make the table; all are kept in the JSON);
    ``passive`` members only serve.
    """

    family = ""

    def __init__(self, key: str) -> None:
        self.key = key
        self.drivers: list[Child] = []
        self.passive: list[Child] = []

    @property
    def children(self) -> list[Child]:
        return [*self.passive, *self.drivers]

    def spawn(self, name: str, script: str, *args: str, env: dict[str, str], log_dir: Path, driver: bool) -> Child:
        child = Child(name, [PY, str(BENCH / script), *args], env, log_dir)
        (self.drivers if driver else self.passive).append(child)
        return child

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        raise NotImplementedError

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for c in self.children:
            c.recv(max(0.01, deadline - time.monotonic()), "start-up")

    def prepare(self, size: Size) -> None:
        """Start what ``setup`` will need at ``size`` (called for every system before any setup)."""

    def setup(self, size: Size) -> None:
        ask_all(self.children, "setup", SETUP_TIMEOUT, bytes=size.nbytes)

    def run(self, size: Size) -> tuple[list[dict[str, list[float]]], float]:
        """One round: each driver's ``{series: [seconds, ...]}``, and the CPU seconds all of this
        system's processes spent per step (warm-up included; user + system, all threads)."""
        timeout = (size.warmup + size.iters) * STEP_TIMEOUT + 30
        pids = [c.proc.pid for c in self.children]
        before = sum(cpu_seconds(p) for p in pids)
        answers = ask_all(self.drivers, "run", timeout, iters=size.iters, warmup=size.warmup)
        cpu = sum(cpu_seconds(p) for p in pids) - before
        steps = (size.warmup + size.iters) * len(answers[0]["samples"])
        return [r["samples"] for r in answers], cpu / steps

    def finish(self, size: Size) -> None:
        """Release what ``setup`` built (between sizes)."""


class Memcpy(System):
    family = "memcpy"

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        self.spawn("memcpy", "floor.py", "memcpy", env=env, log_dir=log_dir, driver=True)


class Tcp(System):
    family = "tcp"

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        self.server = self.spawn("tcp-server", "floor.py", "tcp-server", env=env, log_dir=log_dir, driver=False)
        self.env, self.log_dir = env, log_dir

    def wait_ready(self, timeout: float) -> None:
        port = self.server.recv(timeout, "start-up")["port"]
        client = self.spawn(
            "tcp-client", "floor.py", "tcp-client", "--port", str(port), env=self.env, log_dir=self.log_dir, driver=True
        )
        client.recv(timeout, "start-up")

    def setup(self, size: Size) -> None:
        ask_all(self.drivers, "setup", SETUP_TIMEOUT, bytes=size.nbytes)


class Gloo(System):
    family = "gloo"

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        port = str(free_port())
        for r in range(2):
            args = ("--rank", str(r), "--world-size", "2", "--port", port)
            self.spawn(f"gloo-{r}", "gloo_allreduce.py", *args, env=env, log_dir=log_dir, driver=True)


class RpcPS(System):
    family = "rpc"

    def __init__(self, key: str, workers: int) -> None:
        super().__init__(key)
        self.workers = workers

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        port = str(free_port())
        common = ("--workers", str(self.workers), "--port", port)
        self.spawn(f"rpc{self.workers}-ps", "rpc_ps.py", "--rank", "0", *common, env=env, log_dir=log_dir, driver=False)
        for r in range(1, self.workers + 1):
            name = f"rpc{self.workers}-worker{r}"
            self.spawn(name, "rpc_ps.py", "--rank", str(r), *common, env=env, log_dir=log_dir, driver=True)


class GrpcPS(System):
    """Worker drivers live for the whole run; shard processes (``python -m ps_server.cli``) are
    started per size, since a shard's plan is fixed at Init."""

    family = "grpc-ps"

    def __init__(self, key: str, workers: int, shards: int, partition_bytes: int, wire_dtype: str = "float32") -> None:
        super().__init__(key)
        self.workers, self.shards, self.partition_bytes = workers, shards, partition_bytes
        self.wire_dtype = wire_dtype
        self.shard_procs: list[Child] = []

    @property
    def children(self) -> list[Child]:
        return [*self.shard_procs, *self.drivers]

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        self.env, self.log_dir = env, log_dir
        tag = self.key.replace(" ", "").replace("×", "x")
        for r in range(self.workers):
            args = ("--rank", str(r), "--workers", str(self.workers))
            self.spawn(f"{tag}-worker{r}", "grpc_ps.py", *args, env=env, log_dir=log_dir, driver=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for c in self.drivers:
            c.recv(max(0.01, deadline - time.monotonic()), "start-up")

    def prepare(self, size: Size) -> None:
        tag = self.key.replace(" ", "").replace("×", "x")
        for k in range(self.shards):
            argv = shard_argv(k, self.shards, self.workers)
            self.shard_procs.append(Child(f"{tag}-{size.label}-shard{k}", argv, self.env, self.log_dir))

    def setup(self, size: Size) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        servers = [
            c.wait_for(r"listening on (\S+)", max(0.01, deadline - time.monotonic())).group(1) for c in self.shard_procs
        ]
        ask_all(
            self.drivers,
            "setup",
            SETUP_TIMEOUT,
            servers=servers,
            bytes=size.nbytes,
            model=size.model,
            partition_bytes=self.partition_bytes,
            wire_dtype=self.wire_dtype,
        )

    def finish(self, size: Size) -> None:
        ask_all(self.drivers, "close", SETUP_TIMEOUT)
        stop_all(self.shard_procs, grace=0.0)
        self.shard_procs = []


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


def kib(n: int) -> str:
    return f"{n // 1024} KiB" if n < 1 << 20 else f"{n >> 20} MiB"


WIRE_SUFFIX = {"float32": "", "bfloat16": " bf16", "float16": " fp16"}


def systems_for(
    size: Size,
    quick: bool,
    partitions: Sequence[int],
    families: Sequence[str] = FAMILIES,
    grid: Sequence[tuple[int, int]] = GRID,
    wire_dtypes: Sequence[str] = ("float32",),
) -> list[tuple[str, str, int, int, int, str]]:
    """(key, family, workers, shards, partition_bytes, wire dtype) measured at ``size``, of
    ``families`` only."""
    out: list[tuple[str, str, int, int, int, str]] = [
        ("memcpy", "memcpy", 1, 0, 0, "float32"),
        ("loopback TCP", "tcp", 1, 0, 0, "float32"),
    ]
    out += [("gloo all_reduce 2 ranks", "gloo", 2, 0, 0, "float32"), ("rpc PS 1w", "rpc", 1, 1, 0, "float32")]
    if size.model == "digits":
        grid = [(1, 1)]
    else:
        out.append(("rpc PS 2w", "rpc", 2, 1, 0, "float32"))
        grid = [(1, 1), (2, 2)] if quick else grid
    for wire in wire_dtypes:
        for w, s in grid:
            for pb in partitions:
                suffix = ("" if len(partitions) == 1 else f" p={kib(pb)}") + WIRE_SUFFIX[wire]
                out.append((f"grpc-ps {w}w×{s}s{suffix}", "grpc-ps", w, s, pb, wire))
    return [spec for spec in out if spec[1] in families]


def build(key: str, family: str, workers: int, shards: int, partition_bytes: int, wire_dtype: str) -> System:
    if family == "memcpy":
        return Memcpy(key)
    if family == "tcp":
        return Tcp(key)
    if family == "gloo":
        return Gloo(key)
    if family == "rpc":
        return RpcPS(key, workers)
    return GrpcPS(key, workers, shards, partition_bytes, wire_dtype)


@dataclass
class Series:
    """Samples of one (size, system, series, rank), per round."""

    size: Size
    system: str
    family: str
    series: str
    rank: int
    rounds: list[list[float]] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    """CPU seconds per step of all the system's processes, one value per round."""

    @property
    def samples(self) -> list[float]:
        return [s for r in self.rounds for s in r]


def measure(args: argparse.Namespace, log_dir: Path) -> tuple[list[Series], dict[str, float]]:
    """Start every system, then per size: set up, run the rounds alternating, release."""
    env = child_env(args.threads)
    sizes = [QUICK_SIZE] if args.quick else [SIZES[s] for s in args.sizes.split(",")]
    plans = {
        size.label: systems_for(size, args.quick, args.partitions, args.systems, args.grid, args.wire_dtypes)
        for size in sizes
    }
    systems: dict[str, System] = {}
    for plan in plans.values():
        for spec in plan:
            systems.setdefault(spec[0], build(*spec))
    results: dict[tuple[str, str, str, int], Series] = {}
    timings: dict[str, float] = {}
    started = time.perf_counter()
    try:
        for s in systems.values():
            s.start(env, log_dir)
        for spec in plans[sizes[0].label]:  # the first size's shards start with everything else
            systems[spec[0]].prepare(sizes[0])
        for s in systems.values():
            s.wait_ready(STARTUP_TIMEOUT)
        timings["start-up s"] = time.perf_counter() - started
        print(f"bench: {len(systems)} systems started in {timings['start-up s']:.0f} s; logs in {log_dir}", flush=True)
        for size in sizes:
            t0 = time.perf_counter()
            active = [systems[spec[0]] for spec in plans[size.label]]
            if size != sizes[0]:
                for s in active:
                    s.prepare(size)
            for s in active:
                s.setup(size)
            for rnd in range(args.rounds):
                for s in active:  # A B C ... in every round
                    answers, cpu = s.run(size)
                    for rank, samples in enumerate(answers):
                        for name, values in samples.items():
                            key = (size.label, s.key, name, rank)
                            series = results.setdefault(key, Series(size, s.key, s.family, name, rank))
                            series.rounds.append(values)
                            series.cpu.append(cpu)
                print(f"bench: {size.label} round {rnd + 1}/{args.rounds} done", flush=True)
            for s in active:
                s.finish(size)
            timings[f"{size.label} s"] = time.perf_counter() - t0
    finally:
        stop_all([c for s in systems.values() for c in s.children])
    timings["total s"] = time.perf_counter() - started
    return list(results.values()), timings


# ---------------------------------------------------------------------- report
def find(results: Sequence[Series], size: str, system: str, series: str | None = None) -> Series | None:
    for r in results:
        if r.size.label == size and r.system == system and r.rank == 0 and (series is None or r.series == series):
            return r
    return None


@dataclass(frozen=True)
class Ratio:
    name: str
    numerator: Series
    denominator: Series
    target: str
    met: bool | None
    value: float
    paired: tuple[float, float]


def ratio(name: str, a: Series | None, b: Series | None, target: str, ok: Any) -> Ratio | None:
    """median(a) / median(b); ``paired``: min-max of the per-round ratios of medians."""
    if a is None or b is None:
        return None
    value = statistics.median(a.samples) / statistics.median(b.samples)
    per_round = [statistics.median(x) / statistics.median(y) for x, y in zip(a.rounds, b.rounds, strict=False)]
    return Ratio(name, a, b, target, bool(ok(value)), value, (min(per_round), max(per_round)))


def ratios(results: Sequence[Series]) -> list[Ratio]:
    """The issue's four targets, at the largest size measured (and the small model)."""
    sizes = sorted({r.size for r in results if r.size.model == "flat"}, key=lambda s: s.nbytes)
    out: list[Ratio | None] = []
    if sizes:
        big = sizes[-1].label
        grpc11 = find(results, big, "grpc-ps 1w×1s")
        out.append(
            ratio(
                f"(1) grpc-ps 1w×1s push+pull / loopback TCP round trip, {big}",
                grpc11,
                find(results, big, "loopback TCP"),
                "≤ 1.5",
                lambda v: v <= 1.5,
            )
        )
        out.append(
            ratio(
                f"(2) grpc-ps 2w×2s sync step / gloo all_reduce, {big}",
                find(results, big, "grpc-ps 2w×2s"),
                find(results, big, "gloo all_reduce 2 ranks"),
                "≤ 2.0",
                lambda v: v <= 2.0,
            )
        )
        out.append(
            ratio(
                f"(2) grpc-ps 2w×2s bf16 sync step / gloo all_reduce, {big}",
                find(results, big, "grpc-ps 2w×2s bf16"),
                find(results, big, "gloo all_reduce 2 ranks"),
                "≤ 1.2",
                lambda v: v <= 1.2,
            )
        )
        for size in sizes:
            for w, shards in ((1, (1, 2)), (2, (1, 2))):
                for s in shards:
                    out.append(
                        ratio(
                            f"(3) rpc PS {w}w / grpc-ps {w}w×{s}s (speed-up), {size.label}",
                            find(results, size.label, f"rpc PS {w}w"),
                            find(results, size.label, f"grpc-ps {w}w×{s}s"),
                            "≥ 2.5",
                            lambda v: v >= 2.5,
                        )
                    )
    small = find(results, "small", "grpc-ps 1w×1s")
    if small is not None:
        ms = statistics.median(small.samples) * 1000
        per_round = [statistics.median(r) * 1000 for r in small.rounds]
        out.append(
            Ratio(
                "(4) small-model sync step, grpc-ps 1w×1s, median ms",
                small,
                small,
                "≤ 1.5 ms",
                ms <= 1.5,
                ms,
                (min(per_round), max(per_round)),
            )
        )
    return [r for r in out if r is not None]


def table(
    results: Sequence[Series], found: Sequence[Ratio], args: argparse.Namespace, timings: dict[str, float]
) -> str:
    """The printed report: one row per (size, system, series), then the targets."""
    lines = []
    head = f"{'size':<6} {'system':<26} {'series':<13} {'median ms':>10} {'min–max ms':>19} {'GB/s':>6} {'CPU ms':>7}"
    head += f" {'n':>4}"
    lines += [head, "-" * len(head)]
    for r in results:
        if r.rank != 0:
            continue
        d = describe(r.samples)
        gbs = r.size.nbytes / d["median"] / 1e9
        span = f"{d['min'] * 1000:.3f}–{d['max'] * 1000:.2f}"
        median, n, cpu = d["median"] * 1000, d["n"], statistics.median(r.cpu) * 1000
        row = f"{r.size.label:<6} {r.system:<26} {r.series:<13} {median:>10.3f} {span:>19} {gbs:>6.2f} {cpu:>7.1f}"
        lines.append(f"{row} {n:>4}")
    lines.append("")
    lines.append("GB/s = payload bytes / median step (a step moves the payload up and down: push+pull, round trip).")
    lines.append("CPU ms = CPU time (user + system, all threads) of all the system's processes per step, median of")
    lines.append("the rounds; it does not depend on how much of the machine other processes take.")
    lines.append("")
    lines.append(f"{'target':<62} {'value':>7} {'per-round':>13} {'goal':>9}  met")
    for q in found:
        lo, hi = q.paired
        mark = "yes" if q.met else "NO"
        lines.append(f"{q.name:<62} {q.value:>7.2f} {f'{lo:.2f}–{hi:.2f}':>13} {q.target:>9}  {mark}")
    lines.append("")
    lines.append(f"Every measured process ran with GLIBC_TUNABLES={GLIBC_TUNABLES}")
    lines.append(f"and OMP_NUM_THREADS={args.threads}; {os.cpu_count()} cores; {args.rounds} rounds alternating.")
    lines.append("Timings: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
    return "\n".join(lines)


def to_json(results: Sequence[Series], found: Sequence[Ratio], args: argparse.Namespace, timings: dict[str, float]):
    import grpc
    import torch

    return {
        "meta": {
            "command": sys.argv,
            "quick": args.quick,
            "rounds": args.rounds,
            "threads": args.threads,
            "glibc_tunables": GLIBC_TUNABLES,
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "grpcio": grpc.__version__,
            "load_average": list(os.getloadavg()),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "timings_seconds": timings,
        },
        "results": [
            {
                "size": r.size.label,
                "bytes": r.size.nbytes,
                "system": r.system,
                "family": r.family,
                "series": r.series,
                "rank": r.rank,
                **describe(r.samples),
                "rounds": r.rounds,
                "cpu_seconds_per_step": r.cpu,
            }
            for r in results
        ],
        "ratios": [
            {
                "name": q.name,
                "value": q.value,
                "per_round_min": q.paired[0],
                "per_round_max": q.paired[1],
                "target": q.target,
                "met": q.met,
            }
            for q in found
        ],
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke test: 4 MB only, fewer systems and repeats (< 60 s)")
    p.add_argument("--json", default="", help="write every sample and the ratios to this file")
    p.add_argument("--rounds", type=int, default=0, help="rounds per size (default 5, --quick 3)")
    p.add_argument("--sizes", default="small,4,25,100", help="comma-separated of small, 4, 25, 100 (MB)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of every process (OMP_NUM_THREADS)")
    p.add_argument(
        "--partitions",
        default=str(4 << 20),
        help="grpc-ps partition_bytes, comma-separated; more than one measures each (a sweep)",
    )
    p.add_argument("--systems", default=",".join(FAMILIES), help="comma-separated subset of " + ", ".join(FAMILIES))
    p.add_argument("--grid", default="1x1,1x2,2x1,2x2", help="grpc-ps WORKERSxSHARDS configurations")
    p.add_argument(
        "--wire-dtypes",
        default="float32,bfloat16",
        help="grpc-ps wire dtypes, comma-separated (float32, bfloat16, float16); each is its own system",
    )
    p.add_argument("--log-dir", default="", help="children's logs (default: a temporary directory)")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.partitions = [int(x) for x in args.partitions.split(",")]
    args.systems = args.systems.split(",")
    args.wire_dtypes = args.wire_dtypes.split(",")
    if not set(args.wire_dtypes) <= set(WIRE_SUFFIX):
        p.error(f"--wire-dtypes takes some of {', '.join(WIRE_SUFFIX)}, got {args.wire_dtypes}.")
    try:
        args.grid = [tuple(int(v) for v in g.split("x")) for g in args.grid.split(",")]
    except ValueError:
        p.error(f"--grid takes WORKERSxSHARDS pairs like 1x1,2x2, got {args.grid!r}.")
    if not set(args.systems) <= set(FAMILIES):
        p.error(f"--systems takes some of {', '.join(FAMILIES)}, got {args.systems}.")
    if not 1 <= args.rounds <= 100:
        p.error(f"--rounds must be in 1..100, got {args.rounds}.")
    bad = [s for s in args.sizes.split(",") if s not in SIZES]
    if bad:
        p.error(f"Unknown size {bad[0]!r}; expected some of {', '.join(SIZES)}.")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="grpc-ps-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"bench: GLIBC_TUNABLES={GLIBC_TUNABLES} OMP_NUM_THREADS={args.threads} for every measured process")
    try:
        results, timings = measure(args, log_dir)
    except (ChildError, KeyboardInterrupt) as exc:
        print(f"bench: {exc}\nlogs in {log_dir}", file=sys.stderr)
        return 1
    found = ratios(results)
    print(table(results, found, args, timings))
    bad = [r.system for r in results if not all(math.isfinite(s) and s > 0 for s in r.samples)]
    if args.json:
        Path(args.json).write_text(jsonout.dumps(to_json(results, found, args, timings), indent=1))
        print(f"bench: wrote {args.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
