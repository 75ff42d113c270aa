"""Time to first step: ``ps-launch`` against ``torchrun`` on the DDP tutorial script.

Runs, N rounds alternating (torchrun, ps-launch, torchrun, ...), the two commands users type:

    torchrun --standalone --nproc_per_node=2 multigpu_torchrun.py 3 1 --batch_size 32
    ps-launch --shards 2 --workers 2 multigpu_grpc_ps.py 3 1 --batch_size 32

with ``bench/first_step_runner.py`` put before the script (it runs the script unchanged in the same
process and writes each rank's moments; see its docstring), each in a fresh directory (the
scripts resume from ``snapshot.pt`` in the working directory) and bounded by ``--timeout``.
Measured per run, from the moment before the command is started (``time.time()``; every process
is on this machine, on the same clock):

- **first step**: until every rank's first ``optimizer.step()`` returned (the last rank's);
- **wall**: until the command exited;
- **CPU**: user + system seconds of every process of the run, start to exit (``RUSAGE_CHILDREN``):
  what a busy machine does not change much, and what bounds the wall time on few cores;
- the **breakdown**: when every rank reached each start-up moment (the launcher's own stderr lines,
  time-stamped as they arrive, and the runner's marks), as a median over the rounds.

Prints medians and min-max, the ratio ps-launch/torchrun of the medians and per round (the two
runs of a round are neighbours in time), and the load average when each run started.

    python bench/first_step.py --rounds 5 --json first_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "bench" / "first_step_runner.py"
EXAMPLES = ROOT / "examples" / "ddp_tutorial"
SCRIPT_ARGS = ("3", "1", "--batch_size", "32")
RANKS = 2

LAUNCHER_LINES = {
    "ps-launch": (
        ("launcher up", "ps-launch: children run with"),
        ("shards started", "ps-launch: started shard-1"),
        ("shards serving", "shards on 127.0.0.1"),
        ("workers started", f"ps-launch: started worker-{RANKS - 1}"),
    ),
    "torchrun": (),
}
"""Per system: (stage, the start of the launcher's stderr line that marks it)."""

RANK_STAGES = {
    "torchrun": (
        ("rank processes started", "process"),
        ("interpreter up", "interpreter"),
        ("torch imported", "torch"),
        ("init_process_group done", "init_process_group"),
        ("first step", "first_step"),
    ),
    "ps-launch": (
        ("rank processes started", "process"),
        ("interpreter up", "interpreter"),
        ("torch imported", "torch"),
        ("from_env called", "ps_worker.from_env"),
        ("joined every shard", "ps_worker.joined"),
        ("rank 0 wrote the values", "ps_worker.written"),
        ("others saw them", "ps_worker.waited"),
        ("initialized (values pulled)", "ps_worker.initialized"),
        ("first step", "first_step"),
    ),
}
"""Per system: (stage, the runner's mark of it); a stage's time is the last rank's (of those that
have it: only rank 0 writes the values, the others wait for them)."""


def executable(name: str) -> str:
    """The console script ``name`` of this interpreter's environment, else the one on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        sys.exit(f"first_step.py: {name} not found beside {sys.executable} nor on PATH")
    return found


def commands() -> dict[str, list[str]]:
    """Each system's command line, the runner before the script."""
    return {
        "torchrun": [
            executable("torchrun"),
            "--standalone",
            f"--nproc_per_node={RANKS}",
            str(RUNNER),
            str(EXAMPLES / "multigpu_torchrun.py"),
            *SCRIPT_ARGS,
        ],
        "ps-launch": [
            executable("ps-launch"),
            "--shards",
            "2",
            "--workers",
            str(RANKS),
            str(RUNNER),
            str(EXAMPLES / "multigpu_grpc_ps.py"),
            *SCRIPT_ARGS,
        ],
    }


def _read_lines(stream: Any, lines: queue.Queue[tuple[float, str]]) -> None:
    for line in stream:
        lines.put((time.time(), line.rstrip("\n")))


def run_once(system: str, argv: list[str], timeout: float) -> dict[str, Any]:
    """Run ``argv`` once in a fresh directory; returns its moments (seconds from its start).

    A run that fails (exit status, a rank without a first step) or outlives ``timeout`` seconds
    (then SIGTERM, after 10 s SIGKILL of its process group) comes back with ``"error"``."""
    work = Path(tempfile.mkdtemp(prefix=f"first-step-{system}-"))
    marks_dir = work / "marks"
    marks_dir.mkdir()
    env = {
        **os.environ,
        "FIRST_STEP_DIR": str(marks_dir),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    load = os.getloadavg()[0]
    lines: queue.Queue[tuple[float, str]] = queue.Queue()
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    proc = subprocess.Popen(
        argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    error = ""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout:.0f} s"
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this run's Popen made (start_new_session)
            rc = proc.wait(timeout=10)
    end = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # every process of the run: each was waited for
    cpu = after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime
    reader.join(timeout=5)
    output = []
    while not lines.empty():
        output.append(lines.get())
    result: dict[str, Any] = {"system": system, "load": load, "rc": rc, "wall": end - start, "cpu": cpu, "stages": {}}
    for stage, prefix in LAUNCHER_LINES[system]:
        when = next((t for t, line in output if prefix in line), None)
        if when is not None:
            result["stages"][stage] = when - start
    ranks = []
    for rank in range(RANKS):
        try:
            ranks.append(json.loads((marks_dir / f"rank-{rank}.json").read_text()))
        except (OSError, ValueError):
            error = error or f"rank {rank} wrote no moments"
    for stage, mark in RANK_STAGES[system]:
        times = [r[mark] for r in ranks if r.get(mark) is not None]
        if times and (len(times) == RANKS or mark in ("ps_worker.written", "ps_worker.waited")):
            result["stages"][stage] = max(times) - start
    result["ranks"] = [{k: (v - start if isinstance(v, float) else v) for k, v in r.items()} for r in ranks]
    if rc != 0:
        error = error or f"exit status {rc}"
    if "first step" not in result["stages"]:
        error = error or "a rank recorded no first step"
    result["first_step"] = result["stages"].get("first step")
    if error:
        result["error"] = error
        result["output_tail"] = [line for _, line in output[-15:]]
    shutil.rmtree(work, ignore_errors=True)
    return result


def spread(values: list[float]) -> str:
    """``median (min-max)`` in seconds, or ``-`` for no values."""
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def report(runs: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """Print the table and the breakdown; returns the figures (medians, ratios)."""
    ok = {s: [r for r in runs if r["system"] == s and "error" not in r] for s in RANK_STAGES}
    print(f"\n{'system':<10} {'runs ok':>7}  {'first step, every rank':<26} {'wall':<26} {'CPU':<26} load at start")
    for system, good in ok.items():
        loads = [r["load"] for r in runs if r["system"] == system]
        print(
            f"{system:<10} {len(good):>3}/{rounds:<3}  {spread([r['first_step'] for r in good]):<26} "
            f"{spread([r['wall'] for r in good]):<26} {spread([r['cpu'] for r in good]):<26} "
            f"{', '.join(f'{x:.1f}' for x in loads)}"
        )
    figures: dict[str, Any] = {}
    for what in ("first_step", "wall", "cpu"):
        a = [r[what] for r in ok["torchrun"]]
        b = [r[what] for r in ok["ps-launch"]]
        if a and b:
            figures[f"{what}_ratio"] = statistics.median(b) / statistics.median(a)
            rounds_of = ([r for r in runs if r["system"] == s] for s in ("torchrun", "ps-launch"))
            pairs = zip(*rounds_of, strict=True)
            paired = [p[what] / t[what] for t, p in pairs if "error" not in t and "error" not in p]
            figures[f"{what}_ratio_per_round"] = paired
            print(
                f"ratio ps-launch/torchrun, {what.replace('_', ' ')}: {figures[f'{what}_ratio']:.2f} "
                f"(per round {min(paired):.2f}-{max(paired):.2f})"
                + ("  [target <= 1.3]" if what == "first_step" else "")
            )
    for system, good in ok.items():
        if not good:
            continue
        print(f"\n{system}: when the last rank reached each stage (median over {len(good)} runs, from the command)")
        stages = [s for s, _ in LAUNCHER_LINES[system]] + [s for s, _ in RANK_STAGES[system]]
        seen = {s: [r["stages"][s] for r in good if s in r["stages"]] for s in stages}
        figures[f"{system}_stages"] = medians = {s: statistics.median(t) for s, t in seen.items() if t}
        before = 0.0
        for stage, median in sorted(medians.items(), key=lambda item: item[1]):  # in the order they happened
            print(f"  {stage:<30} {median:6.2f} s   (+{median - before:5.2f})")
            before = median
        wall = statistics.median([r["wall"] for r in good])
        print(f"  {'command exited':<30} {wall:6.2f} s   (+{wall - before:5.2f})")
    for r in runs:
        if "error" in r:
            print(f"\n{r['system']} failed: {r['error']}\n  " + "\n  ".join(r.get("output_tail", [])))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each runs torchrun, then ps-launch")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds one command may run")
    parser.add_argument("--json", default="", help="also write every run's moments and the figures here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    argvs = commands()
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)")
    for system, command in argvs.items():
        print(f"{system}: {' '.join(command)}")
    runs = []
    for k in range(args.rounds):
        for system, command in argvs.items():
            result = run_once(system, command, args.timeout)
            runs.append(result)
            state = result.get("error") or f"first step {result['first_step']:.2f} s, wall {result['wall']:.2f} s"
            print(f"round {k + 1}/{args.rounds} {system:<10} {state} (load {result['load']:.2f})", flush=True)
    figures = report(runs, args.rounds)
    if args.json:
        out = {"load_at_start": load, "commands": argvs, "runs": runs, "figures": figures}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
