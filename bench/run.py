"""grpc-ps benchmark: push+pull against the machine's limits and against the peers, alternating in one run.

    python bench/run.py [--quick] [--json out.json]

For each payload size every system is set up once, then measured in rounds, A B C ... A B C ...,
so that load from other processes on the machine falls on all of them alike. Each round of a
system runs a few untimed warm-up steps, then times single steps. The table gives the median
over all timed steps, min-max, and the ratios the performance issue targets; the JSON keeps every
sample. Every measured process is a child started here, with the same environment (glibc malloc
tunables, one intra-op thread) and is killed by its pid at the end. See bench/README.md.

The systems and their processes are in ``systems.py``; the ratios, the table and the JSON in ``report.py``.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from _common import GLIBC_TUNABLES, PROCESS_BASE_BYTES, ChildError, HeadroomError, check_headroom, child_env, stop_all
from report import Series, ratios, table, to_json
from systems import FAMILIES, STARTUP_TIMEOUT, WIRE_SUFFIX, Size, System, build, systems_for

from ps_common import jsonout

DIGITS_BYTES = (64 * 128 + 128 + 128 * 10 + 10) * 4  # 38,952 B
SIZES = {
    "small": Size("small", DIGITS_BYTES, warmup=20, iters=200, model="digits"),
    "4": Size("4MB", 4_000_000, warmup=3, iters=10),
    "25": Size("25MB", 25_000_000, warmup=1, iters=4),
    "100": Size("100MB", 100_000_000, warmup=1, iters=3),
}
QUICK_SIZE = Size("4MB", 4_000_000, warmup=2, iters=5)


def measure(args: argparse.Namespace, log_dir: Path) -> tuple[list[Series], dict[str, float]]:
    """Start every system, then per size: set up, run the rounds alternating, release."""
    env = child_env(args.threads)
    sizes = [QUICK_SIZE] if args.quick else [SIZES[s] for s in args.sizes.split(",")]
    plans = {
        size.label: systems_for(
            size, args.quick, args.partitions, args.systems, args.grid, args.wire_dtypes, args.before is not None
        )
        for size in sizes
    }
    systems: dict[str, System] = {}
    for plan in plans.values():
        for spec in plan:
            systems.setdefault(spec[0], build(*spec, before=args.before))
    results: dict[tuple[str, str, str, int], Series] = {}
    timings: dict[str, float] = {}
    started = time.perf_counter()
    try:
        for s in systems.values():
            s.start(env, log_dir)
        first = [systems[spec[0]] for spec in plans[sizes[0].label]]
        check_headroom(
            PROCESS_BASE_BYTES * sum(s.processes_to_prepare() for s in first),
            f"start the shards of {len(first)} systems at {sizes[0].label}",
        )
        for s in first:  # the first size's shards start with everything else
            s.prepare(sizes[0])
        for s in systems.values():
            s.wait_ready(STARTUP_TIMEOUT)
        timings["start-up s"] = time.perf_counter() - started
        print(f"bench: {len(systems)} systems started in {timings['start-up s']:.0f} s; logs in {log_dir}", flush=True)
        for size in sizes:
            t0 = time.perf_counter()
            active = [systems[spec[0]] for spec in plans[size.label]]
            if size != sizes[0]:
                check_headroom(
                    PROCESS_BASE_BYTES * sum(s.processes_to_prepare() for s in active),
                    f"start the shards of {len(active)} systems at {size.label}",
                )
                for s in active:
                    s.prepare(size)
            for s in active:
                check_headroom(s.memory_need(size), f"set up {s.key} at {size.label}")
                s.setup(size)
            for rnd in range(args.rounds):
                for s in active:  # A B C ... in every round
                    if rnd == 0:  # a system's first steps allocate its buffers; after them it keeps its size
                        check_headroom(s.memory_need(size), f"step {s.key} at {size.label}")
                    answers, cpu = s.run(size)
                    for rank, samples in enumerate(answers):
                        for name, values in samples.items():
                            key = (size.label, s.key, name, rank)
                            series = results.setdefault(key, Series(size, s.key, s.family, name, rank))
                            series.rounds.append(values)
                            series.cpu.append(cpu["all"])
                            for side, seconds in cpu.items():
                                if side != "all":
                                    series.cpu_sides.setdefault(side, []).append(seconds)
                print(f"bench: {size.label} round {rnd + 1}/{args.rounds} done", flush=True)
            for s in active:
                s.finish(size)
            timings[f"{size.label} s"] = time.perf_counter() - t0
    finally:
        stop_all([c for s in systems.values() for c in s.children])
    timings["total s"] = time.perf_counter() - started
    return list(results.values()), timings


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
    p.add_argument(
        "--grid",
        default="1x1,2x2",
        help="grpc-ps WORKERSxSHARDS configurations (each size's systems are all alive at once: "
        "1x2 and 2x1 too, at 100 MB, need more than 24 GiB of memory)",
    )
    p.add_argument(
        "--wire-dtypes",
        default="float32,bfloat16",
        help="grpc-ps wire dtypes, comma-separated (float32, bfloat16, float16); each is its own system",
    )
    p.add_argument("--log-dir", default="", help="children's logs (default: a temporary directory)")
    p.add_argument(
        "--before",
        default="",
        help="another checkout of grpc-ps (e.g. `git worktree add /tmp/before <commit>`): each grpc-ps "
        "configuration also runs its code, as 'KEY before', in the same rounds",
    )
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
    args.before = Path(args.before).resolve() if args.before else None
    if args.before is not None and not (args.before / "bench" / "grpc_ps.py").is_file():
        p.error(f"--before must be a checkout of grpc-ps (with bench/grpc_ps.py), got {str(args.before)!r}.")
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
    except (ChildError, HeadroomError, KeyboardInterrupt) as exc:
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
