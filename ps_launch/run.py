"""One ps-launch run: start the shards, then one worker per rank (``ps-worker`` for a built-in
workload, the user's script otherwise), show their progress, inject ``--fault``, summarize.

Progress of a built-in workload comes from ``ps-worker --events`` lines; a user's script prints none,
so its progress line follows the rank's clock as shard 0 reports it (``Admin/GetStatus``, twice a
second). Either way: exit status 0 only when every worker exits 0 (or was not needed: a rank that a
later ``--resize`` left out of the job before it trained), 1 when one fails (its log's tail is
shown), 130 on Ctrl-C; no process is left behind.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from tqdm import tqdm

from ps_common import jsonout, tracing
from ps_common.process_env import available_cpus, launch_environment
from ps_launch.cluster import (
    Child,
    Cluster,
    read_events,
    read_output,
    reserve_ports,
    server_flags,
    tail,
)
from ps_launch.faults import Fault, parse_faults, parse_resizes
from ps_launch.save import ModelFileError, save_model, save_target, warm_up
from ps_launch.status import MembershipWatch, resize_job, shard_statuses
from ps_launch.summary import (
    RankRun,
    close_bars,
    finished_version,
    nothing_to_do,
    print_script_summary,
    print_summary,
    summarize,
    summarize_script,
)
from ps_launch.target import Target, free_port, script_environment, worker_argv
from ps_launch.tokens import admin_token, rank_tokens_file, worker_environment
from ps_proto.v1 import ps_pb2
from ps_worker.tensorboard import prepare

Events = queue.Queue[tuple[str, dict[str, Any]]]


def start_worker(
    cluster: Cluster,
    args: Any,
    target: Target | None,
    addresses: list[str],
    rank: int,
    tokens: dict[int, str] | None = None,
) -> Child:
    """Start rank ``rank``'s worker: ``ps-worker`` (built-in workload) or the user's script with the
    environment contract; with ``tokens`` (``--rank-tokens``), its own token and no other credential."""
    own = worker_environment(tokens, rank)
    if target is None:
        return cluster.spawn(f"worker-{rank}", worker_argv(args, addresses, rank), own)
    argv, python_args = target.command()
    return cluster.spawn(f"worker-{rank}", argv, {**script_environment(args, addresses, rank), **own}, python_args)


def follow(child: Child, events: Events, script: bool) -> None:
    """Forward ``child``'s events to ``events`` from a thread of its own."""
    threading.Thread(target=read_output if script else read_events, args=(child, events), daemon=True).start()


def run(args: Any, target: Target | None = None) -> int:
    """Start the cluster, watch the workers, summarize. Returns the exit status."""
    if args.shards < 1 or args.workers < 1 or args.steps < 1:
        print("ps-launch: --shards, --workers and --steps must be >= 1.", file=sys.stderr)
        return 2
    try:
        faults = parse_faults(args.fault, args.shards, args.workers)
        resizes = parse_resizes(getattr(args, "resize", ""))
        tracing.check_installed(args.otel_endpoint)
    except (ValueError, tracing.TracingUnavailableError) as exc:
        print(f"ps-launch: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "tensorboard", ""):  # before anything starts: a missing package fails here, not mid-run
        try:
            where = prepare(args.tensorboard, args.tensorboard_every)
            print(f"ps-launch: TensorBoard curves in {where}", file=sys.stderr)
        except (ImportError, ValueError) as exc:
            print(f"ps-launch: {exc}", file=sys.stderr)
            return 2
    script = target is not None
    if getattr(args, "init_from", "") and (script or not os.path.isfile(args.init_from)):
        what = "a built-in workload's model; a script loads its own (ps_worker.model_file.init_from)"
        print(f"ps-launch: --init-from {args.init_from}: " + (what if script else "no such file"), file=sys.stderr)
        return 2
    if target is not None:
        args.workload = target.label
        args.master_port = free_port()  # MASTER_PORT of every rank: a gloo process group may form beside grpc-ps
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="ps-launch-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        save_to = save_target(args, log_dir)  # checked now: a bad --save fails before the training
    except ModelFileError as exc:
        print(f"ps-launch: --save: {exc}", file=sys.stderr)
        return 2
    if save_to:
        warm_up()
    saved = None
    tokens, token_flags = None, []
    if getattr(args, "rank_tokens", False):
        try:
            path, tokens = rank_tokens_file(log_dir, max([args.workers, *(n for _, n in resizes)]))
            drawn = admin_token(log_dir, os.environ)
        except (ValueError, OSError) as exc:
            print(f"ps-launch: --rank-tokens: {exc}", file=sys.stderr)
            return 2
        if drawn:  # the shards' admin token, and ps-launch's own for its Admin calls; never a worker's
            os.environ["PS_ADMIN_TOKEN"] = drawn
        token_flags = ["--rank-tokens", str(path)]
        print(f"ps-launch: a token per rank in {path}; each worker holds only its own", file=sys.stderr)
    environment = launch_environment(os.environ, args.shards + args.workers, available_cpus())
    if args.otel_endpoint:  # every shard and worker traces (ps_common.tracing)
        environment["PS_OTEL_ENDPOINT"] = args.otel_endpoint
    cluster = Cluster(log_dir, environment, shard_host=not getattr(args, "no_shard_host", False))
    print(
        f"ps-launch: children run with OMP_NUM_THREADS={cluster.env['OMP_NUM_THREADS']} "
        f"GLIBC_TUNABLES={cluster.env['GLIBC_TUNABLES']}",
        file=sys.stderr,
    )
    bars: list[tqdm] = []
    failed = False
    started = time.perf_counter()
    events: Events = queue.Queue()
    workers: list[Child] = []

    def start_workers(addresses: list[str]) -> None:
        for r in range(args.workers):
            workers.append(start_worker(cluster, args, target, addresses, r, tokens))
            follow(workers[-1], events, script)

    # A fresh job (no checkpoint to resume, so not finished either) starts its workers while its shards
    # start, on ports held for them: the workers' imports overlap the shards' (bench/first_step.py).
    fresh = not any(log_dir.glob("checkpoints/shard-*-v*.pt"))  # lock files are no checkpoint
    reserved = reserve_ports(args.shards) if fresh else []
    try:
        addresses = cluster.start_shards(
            args.shards,
            args.workers,
            args.mode,
            server_flags(args, log_dir) + token_flags,
            metrics=not args.no_metrics,
            reserved=reserved,
            meanwhile=start_workers if reserved else None,
        )
        where = f"logs in {log_dir}" + (
            "" if args.log_dir else " (removed at the end unless the run fails; --log-dir keeps them)"
        )
        print(f"ps-launch: {args.shards} shards on {', '.join(addresses)}; {where}", file=sys.stderr)
        for c in cluster.children:
            if c.metrics_url:
                print(f"ps-launch: {c.name} metrics on {c.metrics_url}", file=sys.stderr)
        if not workers:
            finished = finished_version(shard_statuses(addresses), args.steps)
            if finished is not None:  # a finished job run again: say so, rather than train nothing
                nothing_to_do(args, log_dir, finished, sys.stdout)
                if save_to:
                    print(f"ps-launch: model saved: {save_model(save_to, addresses)}", file=sys.stderr)
                return 0
            start_workers(addresses)
        fired: list[dict[str, Any]] = []
        restarts: list[str] = []
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
        said: dict[int, dict[str, Any]] = {}  # a script's own {"event": "done", ...} lines, by rank
        exited: set[str] = set()
        killed: dict[str, Fault] = {}
        # a killed worker with `,restart` starts again once the shards evicted it (or after three leases),
        # so the console shows the kill, the eviction and the rejoin in that order: worker name -> deadline
        respawn: dict[str, float] = {}
        shards = [c for c in cluster.children if c.name.startswith("shard-")]
        runs: dict[int, list[RankRun]] = {r: [] for r in range(args.workers)}
        first_step: float | None = None
        last_step = 0.0
        announce = bool(faults)  # membership changes go on the console when faults are injected
        watch = MembershipWatch(addresses[0]) if announce or script else None
        incarnations: dict[int, int] = {}  # a script's rank -> the incarnation its current run started with
        size = [args.workers]  # the job's worker count after the resizes fired so far
        unneeded: list[str] = []  # workers a later resize left out before they trained

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

        def resize(step: int) -> None:
            """Resize the job at ``step`` (shard 0 decides; every shard follows): start the new ranks;
            ranks beyond the new count stop by themselves at the resize's round."""
            _, n = resizes.pop(0)
            answer = resize_job(addresses[0], n)
            size[0] = n
            fired.append({"resize": n, "step": step, "at_version": answer.at_version})
            tqdm.write(
                f"ps-launch: resized from {answer.previous_num_workers} to {n} workers at step {step} "
                f"(from version {answer.at_version})",
                file=sys.stderr,
            )
            grown = argparse.Namespace(**{**vars(args), "workers": n})
            for r in range(len(workers), n):
                child = start_worker(cluster, grown, target, addresses, r, tokens)
                workers.append(child)
                runs[r] = []
                bars.append(tqdm(total=args.steps, desc=f"rank {r}", position=r, unit="step", file=sys.stderr,
                                 disable=args.no_progress or None, dynamic_ncols=True, leave=False))  # fmt: skip
                follow(child, events, script)

        def script_progress() -> None:
            """A script's start and step events, from the clocks shard 0 reports."""
            assert watch is not None
            for rank, (clock, incarnation) in sorted(watch.clocks.items()):
                name = f"worker-{rank}"
                if name in exited or name in killed or name in respawn:
                    continue
                if incarnations.get(rank) != incarnation:
                    # a fresh job's first ranks start at 0, however far the first poll of shard 0 finds them
                    fresh_rank = fresh and rank not in incarnations and rank < args.workers
                    incarnations[rank] = incarnation
                    events.put((name, {"event": "start", "step": 0 if fresh_rank else clock}))
                elif runs[rank] and clock > runs[rank][-1].last:
                    events.put((name, {"event": "step", "step": clock, "loss": float("nan")}))

        while len(exited) < len(workers):
            if watch is not None:
                for line in watch.changes():
                    if announce:
                        tqdm.write(f"ps-launch: {line}", file=sys.stderr)
                if script:
                    script_progress()
            for name in list(respawn):
                evicted = watch is not None and watch.seen.get(int(name.split("-")[1]), (0,))[0] == (
                    ps_pb2.WORKER_STATE_EVICTED
                )
                if evicted or time.monotonic() > respawn[name]:
                    del respawn[name]
                    rank = int(name.split("-")[1])
                    workers[rank] = cluster.respawn(workers[rank])
                    follow(workers[rank], events, script)
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
                if event["loss"] == event["loss"]:  # a script's steps carry no loss (nan)
                    bars[rank].set_postfix(loss=f"{event['loss']:.4f}", refresh=False)
                for fault in [f for f in faults if f.due(rank, event["step"])]:
                    faults.remove(fault)
                    inject(fault, event["step"])
                if resizes and event["step"] >= resizes[0][0]:
                    resize(event["step"])
            elif event.get("event") == "metrics":
                workers[rank].metrics_url = event["url"]
                tqdm.write(f"ps-launch: {name} metrics on {event['url']}", file=sys.stderr)
            elif event.get("event") == "done" and script:
                said[rank] = {**said.get(rank, {}), **event}
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
                if script and code == 0:
                    done[name] = script_done(rank, addresses, runs[rank], said.get(rank, {}))
                    last_step = max(last_step, time.perf_counter())
                if code != 0 and rank >= size[0] and not runs[rank]:
                    # started for a resize that a later one undid before it trained: its work is not needed
                    unneeded.append(name)
                    tqdm.write(
                        f"ps-launch: {name} not needed: the job was resized to {size[0]} workers before it "
                        f"trained (exit {code}; log {workers[rank].log_path})",
                        file=sys.stderr,
                    )
                    continue
                if code != 0 or name not in done:
                    raise RuntimeError(f"{name} failed (exit {code}):\n{tail(workers[rank].log_path)}")
        wall = time.perf_counter() - started
        train_seconds = last_step - first_step if first_step is not None else None
        statuses = shard_statuses(addresses)
        saved = save_model(save_to, addresses) if save_to else None  # before the shards stop
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
    if script:
        lines = {int(c.name.split("-")[1]): list(c.last_lines) for c in workers}
        done_by_rank = {int(n.split("-")[1]): d for n, d in done.items()}
        summary = summarize_script(args, done_by_rank, wall, addresses, statuses, runs, lines, train_seconds)
    else:
        metrics_urls = {c.name: c.metrics_url for c in cluster.children if c.metrics_url}
        summary = summarize(
            args, list(done.values()), wall, addresses, statuses, metrics_urls, runs=runs, train_seconds=train_seconds
        )
    summary["faults"] = fired
    summary["restarted"] = restarts
    summary["not_needed"] = unneeded
    summary["saved"] = saved
    (print_script_summary if script else print_summary)(summary, sys.stdout)
    if args.json:
        print(jsonout.dumps(summary), flush=True)
    return 0


def script_done(rank: int, addresses: list[str], runs: list[RankRun], said: dict[str, Any]) -> dict[str, Any]:
    """The report of a script's rank that exited 0: its clock on shard 0 as its steps (it left the
    shards, so its last clock stays), merged with the ``done`` lines it printed; its run gets it."""
    try:
        (status,) = shard_statuses(addresses[:1], timeout=5.0)
        clock = next((w.clock for w in status.workers if w.rank == rank), 0)
    except grpc.RpcError:
        clock = runs[-1].last if runs else 0
    report = {**said, "rank": rank, "steps": clock}
    if not runs:  # it ran and finished between two polls of the shard's status: from a fresh start, then
        runs.append(RankRun(0, clock))
    runs[-1].last = max(runs[-1].last, clock)
    runs[-1].report = report
    return report
