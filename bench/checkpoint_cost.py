"""The cost of periodic checkpoints per training step (a benchmark, not a test).

Runs ``ps-launch --shards 2 --workers 2 --mode sync --steps N --json digits`` with
``--checkpoint-every`` 0 (only at the stop), 50 (ps-launch's default), 25 (compose's and k8s's) and
1, alternating the settings over ``--rounds``, each in a fresh ``--log-dir``. Per run: the training
time per step (the summary's ``train_seconds`` over its steps), the CPU seconds of every process
of the run per step (``RUSAGE_CHILDREN``, start to exit: shards, workers and the launcher; what a
busy machine bends least), and the checkpoints written. With periodic checkpoints the workers also
keep their redo logs (copies of their pushes since the shards' newest checkpoint,
``ps_worker/redo.py``), so the figures include that copy too. Prints medians and each setting's
ratio to ``--checkpoint-every 0``, and the load average.

    python bench/checkpoint_cost.py --steps 300 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = (0, 50, 25, 1)


def run(every: int, steps: int, log_dir: Path, timeout: float) -> dict[str, float]:
    """One ps-launch job; returns its wall, training and CPU seconds per step and checkpoints written."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    cmd = [sys.executable, "-m", "ps_launch.cli", "--shards", "2", "--workers", "2", "--mode", "sync"]
    cmd += ["--steps", str(steps), "--checkpoint-every", str(every), "--log-dir", str(log_dir), "--json", "digits"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    total = 2 * steps
    written = len(list(log_dir.glob("checkpoints/**/*.pt")))
    return {
        "train_ms": 1e3 * float(summary["train_seconds"]) / steps,
        "cpu_ms": 1e3 * cpu / total,
        "wall_s": wall,
        "files": written,
        "sha": summary.get("params_sha256", ""),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    results: dict[int, list[dict[str, float]]] = {e: [] for e in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for every in SETTINGS:
                res = run(every, args.steps, Path(tmp) / f"r{r}-e{every}", args.timeout)
                results[every].append(res)
                print(f"round {r} --checkpoint-every {every}: {res}", flush=True)
    base_train = statistics.median(x["train_ms"] for x in results[0])
    base_cpu = statistics.median(x["cpu_ms"] for x in results[0])
    print(f"\n{'--checkpoint-every':>18} {'train ms/step':>14} {'ratio':>6} {'CPU ms/step':>12} {'ratio':>6}")
    for every in SETTINGS:
        train = statistics.median(x["train_ms"] for x in results[every])
        cpu = statistics.median(x["cpu_ms"] for x in results[every])
        print(f"{every:>18} {train:>14.2f} {train / base_train:>6.2f} {cpu:>12.2f} {cpu / base_cpu:>6.2f}")
    shas = {x["sha"] for rs in results.values() for x in rs}
    print(f"params sha256 of every run: {'one and the same' if len(shas) == 1 else shas}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
