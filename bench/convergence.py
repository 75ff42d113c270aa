"""Convergence of every consistency model on real runs of ``ps-launch`` (not a test: it reports).

Table 1: mode x workers (1, 2, 4) x straggler (none, one) -> digits held-out accuracy and steps/s.
Table 2: sync-mode scaling on noiseless linear regression, 1, 2, 4, 8 workers -> final held-out MSE
(expected <= 1e-6 at every width: N workers x batch b is one process with batch N*b).

Usage: python bench/convergence.py [--quick] [--json results.json]
Each run is a fresh ``ps-launch`` (separate shard and worker processes on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

from ps_common import jsonout

MODES = {
    "sync": [],
    "async": ["--max-staleness", "4"],
    "ssp": ["--staleness", "2"],
    "easgd": ["--communication-period", "10"],
}
STRAGGLER_MS = 20.0


def launch(
    workload: str, mode: str, workers: int, steps: int, extra: list[str], timeout: float = 600
) -> dict[str, Any]:
    """One ps-launch run; returns its JSON summary (or an error record)."""
    cmd = [
        sys.executable,
        "-m",
        "ps_launch.cli",
        "--shards",
        "2",
        "--workers",
        str(workers),
        "--mode",
        mode,
        "--steps",
        str(steps),
        "--json",
        "--no-progress",
        "--no-metrics",
        *MODES.get(mode, []),
        *extra,
        workload,
    ]
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:], "cmd": " ".join(cmd)}
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    summary["launch_seconds"] = time.perf_counter() - started
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 workers only, fewer steps (a smoke run)")
    parser.add_argument("--steps", type=int, default=300, help="digits steps per worker")
    parser.add_argument("--json", default="", help="write every run's summary here")
    parser.add_argument(
        "--scale-lr",
        action="store_true",
        help="async and ssp: lr 0.1/workers (each of their pushes is an optimizer step of its own)",
    )
    parser.add_argument("--linreg-steps", type=int, default=600, help="linreg steps per worker")
    args = parser.parse_args()
    widths = [2] if args.quick else [1, 2, 4]
    steps = 60 if args.quick else args.steps
    results: dict[str, Any] = {"digits": [], "linreg": []}

    print(
        f"digits, 2 shards, {steps} steps per worker, batch 32, server SGD lr 0.1 momentum 0.9;"
        f" straggler = the last rank sleeps {STRAGGLER_MS:g} ms before each push\n"
    )
    print(
        "| mode | workers | straggler | held-out accuracy | steps/s (all workers) | refused | dropped | max clock gap |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode in MODES:
        for workers in widths:
            for straggler in [False] if workers == 1 else [False, True]:
                extra = ["--slow-rank", str(workers - 1), "--slow-ms", str(STRAGGLER_MS)] if straggler else []
                if args.scale_lr and mode in ("async", "ssp"):
                    extra += ["--lr", str(0.1 / workers)]
                r = launch("digits", mode, workers, steps, extra)
                r.update(mode=mode, workers=workers, straggler=straggler)
                results["digits"].append(r)
                if "error" in r:
                    print(f"| {mode} | {workers} | {'one' if straggler else 'none'} | failed | | | | |")
                    print(r["error"], file=sys.stderr)
                    continue
                view = r["shards_view"]
                print(
                    f"| {mode} | {workers} | {'one' if straggler else 'none'} | {r['accuracy']:.4f} | "
                    f"{r['steps_per_second']:.1f} | {r['refused_pushes']} | {r['dropped_pushes']} | "
                    f"{view['max_clock_gap']} |",
                    flush=True,
                )

    print(
        f"\nlinreg (noiseless), sync, 2 shards, {args.linreg_steps} steps per worker, batch 32,"
        " SGD lr 0.1 momentum 0.9\n"
    )
    print("| workers | final held-out MSE | <= 1e-6 | steps/s |")
    print("|---|---|---|---|")
    for workers in [2] if args.quick else [1, 2, 4, 8]:
        r = launch("linreg", "sync", workers, args.linreg_steps, [])
        r.update(workers=workers)
        results["linreg"].append(r)
        if "error" in r:
            print(f"| {workers} | failed | | |")
            print(r["error"], file=sys.stderr)
            continue
        print(
            f"| {workers} | {r['eval_loss']:.2e} | {'yes' if r['eval_loss'] <= 1e-6 else 'NO'} | "
            f"{r['steps_per_second']:.1f} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            f.write(jsonout.dumps(results, indent=1))
    failed = [r for table in results.values() for r in table if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
