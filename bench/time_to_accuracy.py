"""Time to accuracy: grpc-ps against DDP (gloo) in real training on emulated links (needs root).

    python bench/time_to_accuracy.py --workers 2,4 --rates 1gbit,100mbit --stragglers none,slow,pauses \\
        --budget-s 40 --json tta.json --plot bench/tta.png
    python bench/time_to_accuracy.py --report tta.json --tolerance 0.1 --plot tta.png   # re-score saved runs
    python bench/time_to_accuracy.py --cleanup      # delete namespaces a killed run left behind

Every run trains the charlm GPT (834k parameters, 3.34 MB float32; ``tta_worker.py``) for
``--budget-s`` seconds of wall clock under one system: DDP over gloo (float32, or its
``bf16_compress_hook``) or grpc-ps (sync, sync with bf16 on the wire, async, ssp, easgd, diloco with
H = 10 and 50: inner AdamW, the shards' outer Nesterov SGD 0.7/0.9), with W
workers and, for grpc-ps, as many shards (``--shards``). Each worker and shard is a host of its own
(a network namespace behind a veth link shaped with tbf at the run's rate, both directions:
``netns.py``, as ``emulated.py``); DDP's ranks are the worker hosts, the TCP store on w0. The
straggler cases make the last rank slow (each step 2x its compute, ``--slow``) or pause at random
(``--pauses``). Rank 0 copies its weights every ``--eval-every-s`` and scores them on the held-out
blocks after its budget; every rank reports its link's byte counters each second.

Per rate and width, the target is grpc-ps sync's held-out loss at the end of its budget without a
straggler, plus ``--tolerance``; each run's time and bytes to reach it, and its loss at the budget,
make the table (``tta_report.py``). Start-up (process start, data, joining) is not in the times.
Runs are one at a time; every process and namespace is gone at the end, also on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tta_report
from _common import BENCH, Child, ChildError, busy_fraction, child_env, cpu_seconds, machine_ticks, shard_argv, stop_all
from netns import Netlab, cleanup, parse_rate, plan_network, sh
from tta_worker import SYSTEMS, calibrate, workload_of

from ps_worker.workloads.charlm import default_corpus

PY = sys.executable
STARTUP_TIMEOUT = 300.0
EVAL_TIMEOUT = 300.0
GLOO_PORT = 29500
STRAGGLERS = ("none", "slow", "pauses")
MODE_FLAGS = {
    "sync": ["--mode", "sync"],
    "sync-bf16": ["--mode", "sync"],
    "async": ["--mode", "async"],
    "ssp": ["--mode", "ssp", "--staleness", "2"],
    "easgd": ["--mode", "easgd", "--communication-period", "10"],
    "diloco-10": ["--mode", "diloco", "--communication-period", "10"],  # outer: DiLoCo's Nesterov SGD 0.7/0.9
    "diloco-50": ["--mode", "diloco", "--communication-period", "50"],
    "avg-50": ["--mode", "diloco", "--communication-period", "50", "--outer-optimizer", '{"name": "sgd", "lr": 1.0}'],
}
"""The shards' flags of each grpc-ps system (``ps-server --help``)."""


def host_tx(lab: Netlab) -> dict[str, int]:
    """Bytes every host's link has sent so far (``ip -s -j link``), by role."""
    out = {}
    for h in lab.plan.hosts:
        text = sh("ip", "-n", h.ns, "-s", "-j", "link", "show", "dev", h.veth_host).stdout
        out[h.role] = int(json.loads(text)[0]["stats64"]["tx"]["bytes"])
    return out


def drain(child: Child) -> list[dict[str, Any]]:
    """The JSON lines a stopped child left in its queue."""
    msgs = []
    for _ in range(1_000_000):
        try:
            line = child.lines.get_nowait()
        except queue.Empty:
            break
        if line is None:
            break
        try:
            msgs.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return msgs


def worker_argv(args: argparse.Namespace, system: str, rank: int, workers: int, straggler: str) -> list[str]:
    """The command of ``rank``; the last rank is the straggler."""
    argv = [PY, str(BENCH / "tta_worker.py"), "--system", system, "--rank", str(rank), "--workers", str(workers)]
    argv += ["--budget-s", str(args.budget_s), "--eval-every-s", str(args.eval_every_s)]
    argv += ["--batch-size", str(args.batch_size), "--lr", str(args.lr), "--seed", str(args.seed)]
    argv += ["--corpus", str(args.corpus)]
    if not args.overlap:
        argv.append("--no-overlap")
    if rank == workers - 1 and straggler == "slow":
        argv += ["--delay-s", str((args.slow - 1) * args.compute_s)]
    if rank == workers - 1 and straggler == "pauses":
        argv += ["--pauses", "--pause-prob", str(args.pause_prob), "--pause-s", args.pause_s]
    return argv


def run_one(
    lab: Netlab, args: argparse.Namespace, log_dir: Path, cell: tuple[str, int, str], system: str, index: int
) -> dict[str, Any]:
    """One run of ``system`` in ``cell`` (rate, workers, straggler); its record (``tta_report.Run``)."""
    rate, workers, straggler = cell
    env = child_env(1)
    tag = f"{index:03d}-{rate}-{workers}w-{straggler}-{system}"
    shards = args.shards or workers
    passive: list[Child] = []
    ranks: list[Child] = []
    run: dict[str, Any] = {"rate": rate, "workers": workers, "straggler": straggler, "system": system}
    run.update(shards=0 if system.startswith("ddp") else shards, load_start=os.getloadavg())

    def child(name: str, role: str, argv: list[str]) -> Child:
        ifname = lab.plan.host(role).veth_host
        return Child(name, lab.argv(role, argv), {**env, "GLOO_SOCKET_IFNAME": ifname}, log_dir)

    try:
        extra: list[str] = []
        if system.startswith("ddp"):
            extra = ["--master-addr", lab.address("w0"), "--port", str(GLOO_PORT + index % 400)]
        else:
            for k in range(shards):
                argv = [*shard_argv(k, shards, workers), "--host", lab.address(f"s{k}"), "--insecure"]
                passive.append(child(f"{tag}-shard{k}", f"s{k}", argv + MODE_FLAGS[system]))
            deadline = time.monotonic() + STARTUP_TIMEOUT
            addrs = [
                c.wait_for(r"listening on (\S+)", max(0.01, deadline - time.monotonic())).group(1) for c in passive
            ]
            extra = ["--servers", ",".join(addrs)]
        for r in range(workers):
            ranks.append(child(f"{tag}-rank{r}", f"w{r}", worker_argv(args, system, r, workers, straggler) + extra))
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for c in ranks:
            c.recv(max(0.01, deadline - time.monotonic()), "start-up")
        run["setup_s"] = time.monotonic() + STARTUP_TIMEOUT - deadline
        tx0 = host_tx(lab)
        pids = [c.proc.pid for c in [*ranks, *passive]]
        cpu0, ticks0 = sum(cpu_seconds(p) for p in pids), machine_ticks()
        t0 = time.time() + 0.5
        for c in ranks:
            c.send("go", t0=t0)
        logs: list[list[dict[str, Any]]] = [[] for _ in ranks]
        deadline = time.monotonic() + args.budget_s + 120
        for _ in range(1_000_000):
            msg = ranks[0].recv(max(0.01, deadline - time.monotonic()), "training")
            if "log" in msg:
                logs[0].append(msg["log"])
            if msg.get("trained"):
                run.update(steps=msg["steps"], paused_s=msg.get("paused_s", 0.0))
                break
        run["cpu_s"] = sum(cpu_seconds(p) for p in pids) - cpu0  # every process of the run, user + system
        run["machine_busy"] = busy_fraction(ticks0, machine_ticks())  # all CPUs, this run's and others'
        run["host_tx_bytes"] = {k: v - tx0[k] for k, v in host_tx(lab).items()}
        stop_all([*ranks[1:], *passive], grace=2.0)
        for r, c in enumerate(ranks[1:], start=1):
            logs[r] = [m["log"] for m in drain(c) if "log" in m]
        evals = []
        deadline = time.monotonic() + EVAL_TIMEOUT
        for _ in range(100_000):
            msg = ranks[0].recv(max(0.01, deadline - time.monotonic()), "scoring")
            if "log" in msg:
                logs[0].append(msg["log"])
            if "eval" in msg:
                evals.append(msg["eval"])
            if msg.get("done"):
                break
        run.update(logs=logs, evals=evals, scoring_s=time.monotonic() + EVAL_TIMEOUT - deadline)
    except ChildError as exc:
        run["error"] = str(exc)[-2000:]
    finally:
        stop_all([*ranks, *passive], grace=2.0)
    run["load_end"] = os.getloadavg()
    return run


def matrix(args: argparse.Namespace) -> list[tuple[tuple[str, int, str], str]]:
    """Every (cell, system) of the run, in the order they run: per rate, width and straggler."""
    return [
        ((rate, w, s), system)
        for rate in args.rates
        for w in args.workers
        for s in args.stragglers
        for system in args.systems
    ]


def measure(args: argparse.Namespace, log_dir: Path) -> list[dict[str, Any]]:
    """Build the network once, then per rate reshape it and run every (cell, system)."""
    n_w = max(args.workers)
    n_s = max(args.shards or w for w in args.workers)
    roles = [f"w{i}" for i in range(n_w)] + [f"s{i}" for i in range(n_s)]
    plan = plan_network(roles, os.getpid(), args.subnet)
    runs: list[dict[str, Any]] = []
    todo = matrix(args)
    with Netlab(plan, parse_rate(args.rates[0]), mtu=args.mtu, latency_ms=args.latency_ms) as lab:
        print(f"tta: {len(plan.hosts)} hosts + switch, namespaces {plan.prefix}-*; logs in {log_dir}", flush=True)
        shaped = None
        for i, (cell, system) in enumerate(todo):
            if cell[0] != shaped:
                lab.shape(parse_rate(cell[0]))
                shaped = cell[0]
            started = time.monotonic()
            run = run_one(lab, args, log_dir, cell, system, i)
            run["run_s"] = time.monotonic() - started
            runs.append(run)
            last = run.get("evals") or [{}]
            print(
                f"tta: [{i + 1}/{len(todo)}] {cell[0]} {cell[1]}w straggler {cell[2]} {system}: "
                + (
                    f"FAILED {run['error'][-300:]}"
                    if "error" in run
                    else f"loss {last[-1].get('loss', float('nan')):.3f} "
                )
                + f"after {run.get('steps', 0)} rank-0 steps; run {run['run_s']:.0f} s; load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    return runs


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    p.add_argument("--workers", default="2,4", help="worker counts, comma-separated")
    p.add_argument("--shards", type=int, default=0, help="grpc-ps shards (0: as many as workers)")
    p.add_argument("--rates", default="1gbit,100mbit", help="link rates (tc style), comma-separated")
    p.add_argument("--stragglers", default=",".join(STRAGGLERS), help="some of none, slow, pauses")
    p.add_argument("--budget-s", type=float, default=12.0, help="seconds of training per run")
    p.add_argument("--eval-every-s", type=float, default=0.0, help="rank 0 copies its weights (0: budget/12)")
    p.add_argument("--tolerance", type=float, default=0.05, help="nats/char added to sync's final loss")
    p.add_argument("--target", type=float, default=None, help="a fixed target loss instead")
    p.add_argument("--batch-size", type=int, default=8, help="blocks of 64 chars per worker and step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW lr (async, ssp: lr / workers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slow", type=float, default=2.0, help="the slow straggler's step-time factor")
    p.add_argument("--pause-prob", type=float, default=0.03, help="the pausing straggler's chance per step")
    p.add_argument("--pause-s", default="0.5,2.0", help="LO,HI seconds of its pauses")
    p.add_argument("--no-overlap", dest="overlap", action="store_false", help="grpc-ps: push after backward")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--latency-ms", type=float, default=50.0, help="tbf latency (its queue's length, in time)")
    p.add_argument("--subnet", type=int, default=78, help="hosts are 10.SUBNET.0.N/24")
    p.add_argument("--json", default="", help="write every run (curves, byte logs) and the rows here")
    p.add_argument("--plot", default="", help="write the loss-against-time PNG here (needs matplotlib)")
    p.add_argument("--log-dir", default="", help="children's logs (default: a temporary directory)")
    p.add_argument("--report", default="", help="score the runs of a --json file again (no runs, no root)")
    p.add_argument("--cleanup", action="store_true", help="delete namespaces left by runs that are gone, then exit")
    args = p.parse_args(argv)
    args.systems = args.systems.split(",")
    args.stragglers = args.stragglers.split(",")
    args.rates = args.rates.split(",")
    try:
        args.workers = [int(w) for w in args.workers.split(",")]
        for r in args.rates:
            parse_rate(r)
    except ValueError as exc:
        p.error(str(exc))
    if not set(args.systems) <= set(SYSTEMS) or not set(args.stragglers) <= set(STRAGGLERS):
        p.error(f"--systems takes some of {', '.join(SYSTEMS)}; --stragglers some of {', '.join(STRAGGLERS)}")
    if any(not 2 <= w <= 8 for w in args.workers) or not 0 <= args.shards <= 8 or not 1 <= args.budget_s <= 3600:
        p.error("--workers 2..8, --shards 0..8, --budget-s 1..3600")
    args.eval_every_s = args.eval_every_s or args.budget_s / 12
    return args


def report(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Print the tables of ``runs``, write the plot when asked; the rows."""
    rows = tta_report.score(runs, args.tolerance, args.target)
    print(tta_report.table(rows) + "\n\n" + tta_report.summary(rows))
    if args.plot:
        tta_report.plot(runs, rows, args.plot)
        print(f"tta: wrote {args.plot}")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        report(json.loads(Path(args.report).read_text())["runs"], args)
        return 0
    if os.geteuid() != 0:
        print("tta: needs root (ip netns, tc)", file=sys.stderr)
        return 2
    if args.cleanup:
        print(f"tta: deleted leftover namespaces {' '.join(cleanup())}")
        return 0
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="grpc-ps-tta-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    args.corpus = log_dir / "corpus.txt"  # read once: 2 s of the standard library's files per process
    args.corpus.write_bytes(default_corpus(1_000_000))
    args.compute_s = calibrate(workload_of(str(args.corpus)), args.batch_size)
    print(f"tta: one forward and backward of a batch: {args.compute_s * 1e3:.0f} ms (the straggler's unit)")
    load0 = os.getloadavg()
    print(
        f"tta: {len(matrix(args))} runs of {args.budget_s:g} s; load {load0[0]:.2f}; {os.cpu_count()} CPUs", flush=True
    )
    try:
        runs = measure(args, log_dir)
    except (ChildError, RuntimeError, KeyboardInterrupt, SystemExit) as exc:
        print(f"tta: {exc}\nlogs in {log_dir}", file=sys.stderr)
        return 1
    print(f"\nload average {load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; budget {args.budget_s:g} s\n")
    rows = report(runs, args)
    if args.json:
        meta = {k: v for k, v in vars(args).items()}
        Path(args.json).write_text(
            json.dumps({"args": meta, "load": [load0, os.getloadavg()], "runs": runs, "rows": rows}, default=str)
        )
        print(f"tta: wrote {args.json}")
    return 1 if any(r.get("error") for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
