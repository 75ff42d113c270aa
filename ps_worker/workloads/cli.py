"""``ps-worker``: train a built-in workload through a grpc-ps cluster as one rank.

Arguments are parsed before torch is imported, so ``--help`` and a mistyped flag answer at once.
Run by hand it shows a progress bar (on a terminal, unless ``--no-progress``) and ends with a
human summary (``--json``: one JSON object instead); Ctrl-C or SIGTERM leaves the shards and exits
130 or 143 without a traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import IO, Any, NoReturn

from ps_common import jsonout, tracing
from ps_worker.workloads.flags import optimizer_spec, ratio, training_flags, worker_parser

__all__ = ["main", "optimizer_spec", "ratio", "training_flags", "worker_parser"]

log = logging.getLogger("ps_worker")


class Stopped(BaseException):
    """SIGINT or SIGTERM arrived: leave the shards and exit ``128 + signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_on_signals() -> None:
    def handler(signum: int, frame: object) -> None:
        # a second signal while leaving must not interrupt the goodbye: ignore the rest
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Stopped(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def print_summary(s: dict[str, Any], out: IO[str]) -> None:
    """The human summary of one rank's run (``s``: ``TrainSummary.to_dict()``)."""
    mib = 1024 * 1024
    run_here = s["steps"] - s["first_step"]
    rows = [
        ("workload", f"{s['workload']} ({s['mode']}, rank {s['rank']})"),
        (
            "steps",
            f"{run_here} here (batch {s['batch_size']})"
            + (f", resumed at step {s['first_step']} of {s['steps']}" if s["first_step"] else ""),
        ),
        ("final loss", "-" if s["final_loss"] is None else f"{s['final_loss']:.4f} (mean of the last 10 steps)"),
        ("held-out accuracy", "-" if s["accuracy"] is None else f"{s['accuracy']:.4f}"),
        ("held-out loss", "-" if s["eval_loss"] is None else f"{s['eval_loss']:.3g}"),
    ]
    if s.get("bits_per_char") is not None:
        rows.append(("bits per char", f"{s['bits_per_char']:.3f}"))
    if s.get("auc") is not None:
        rows.append(("held-out AUC", f"{s['auc']:.4f} (ground truth {s['ground_truth_auc']:.4f})"))
    rows += [
        (
            "training time",
            f"{s['wall_seconds']:.1f} s, {s['steps_per_second']:.1f} steps/s, {s['samples_per_second']:.0f} samples/s",
        ),
        ("bytes moved", f"pushed {s['pushed_bytes'] / mib:.1f} MiB, pulled {s['pulled_bytes'] / mib:.1f} MiB"),
        ("final version", f"{s['version']} (clock {s['clock']})"),
        ("refused / dropped", f"{s['refused_pushes']} refused as too stale, {s['dropped_pushes']} dropped late"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"ps-worker rank {s['rank']} summary", file=out)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}", file=out)
    out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Exit status: 0 done, 1 a shard refused or could not be reached, 2 bad flags,
    130/143 interrupted by SIGINT/SIGTERM (after leaving the shards). Started without
    ``GLIBC_TUNABLES``, the process restarts itself with them once its flags are known to be good
    (:func:`ps_common.process_env.tune_malloc_at_start`)."""
    parser = worker_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.rank < args.num_workers:
        parser.error(f"--rank must be in 0..{args.num_workers - 1}, got {args.rank}")
    from ps_common.channels import parse_servers  # grpc, not torch: still fast

    try:  # a malformed address is refused here, before any connection is attempted
        args.servers = ",".join(parse_servers(args.servers))
    except ValueError as exc:
        print(f"ps-worker: {exc}", file=sys.stderr)
        return 2
    if not -1 <= args.metrics_port <= 65535:
        parser.error(f"--metrics-port must be in -1..65535 (-1: off), got {args.metrics_port}")
    if args.tensorboard:  # a missing package fails here, before torch loads and the shards are joined
        from ps_worker.tensorboard import prepare

        try:
            prepare(args.tensorboard, args.tensorboard_every)
        except (ImportError, ValueError) as exc:
            print(f"ps-worker: {exc}", file=sys.stderr)
            return 2
    if argv is None:  # the command line of this process: restart it with the malloc tuning if it lacks it
        from ps_common.process_env import dump_stacks_on_signal, tune_malloc_at_start

        tune_malloc_at_start()
        dump_stacks_on_signal()
    _stop_on_signals()
    logging.basicConfig(level=args.log_level, format="ps-worker %(levelname)s %(name)s: %(message)s")
    try:
        tracing.configure(args.otel_endpoint, "ps-worker", {"ps.rank": args.rank})
    except tracing.TracingUnavailableError as exc:
        print(f"ps-worker: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(parser, args)
    except Stopped as stop:
        if argv is None:  # this process's own command line: it ends here
            _exit_after_goodbye(128 + stop.signum)
        return 128 + stop.signum


def _exit_after_goodbye(code: int) -> NoReturn:
    """End the process with ``code`` once a signal's goodbye is done (the shards left, the line
    printed), skipping the interpreter's finalization: gRPC's channel threads (daemons) may still
    be handling the calls the close cancelled, and during finalization one fails on its completion
    queue's shutdown (``TypeError: 'NoneType' object is not callable`` in ``channel_spin``, a
    traceback on stderr after a clean stop; seen once in CI)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _run(parser: Any, args: Any) -> int:
    # heavy imports after the arguments are known to be good
    import grpc
    import torch
    from prometheus_client import CollectorRegistry

    from ps_common.errors import PSError
    from ps_common.flags import secret
    from ps_common.metrics_endpoint import serve_metrics
    from ps_worker.client import PSClient
    from ps_worker.metrics import WorkerMetrics
    from ps_worker.tensorboard import TrainingLog
    from ps_worker.workloads.registry import get_workload
    from ps_worker.workloads.train import train

    me = f"ps-worker rank {args.rank}"
    servers = args.servers.split(",")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        workload = get_workload(args.workload, corpus=args.corpus)
        token = secret(args.token, args.token_file, "--token")
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    metrics, endpoint = None, None
    if args.metrics_port >= 0:
        metrics = WorkerMetrics(CollectorRegistry())
        try:
            endpoint = serve_metrics(metrics.registry, args.metrics_host, args.metrics_port)
        except RuntimeError as exc:
            print(f"{me}: {exc}", file=sys.stderr)
            return 1
        print(f"{me}: metrics on {endpoint.url}", file=sys.stderr, flush=True)
        if args.events:
            print(jsonout.dumps({"event": "metrics", "rank": args.rank, "url": endpoint.url}), flush=True)
    progress = Progress(args, me)
    client = None
    curves = TrainingLog(args.tensorboard or None, args.rank, every=args.tensorboard_every)
    step_at = [0]
    try:
        client = PSClient(
            servers,
            args.rank,
            args.num_workers,
            incarnation=args.incarnation,
            token=token or None,
            timeout=args.timeout,
            retry_deadline=args.retry_deadline,
            wait_timeout=args.wait_timeout,
            tls_ca=args.tls_ca or None,
            tls_cert=args.tls_cert or None,
            tls_key=args.tls_key or None,
            metrics=metrics,
            wire_dtype=None if args.wire_dtype == "native" else args.wire_dtype,
            topk=args.topk,
            data_path=args.data_path,
        )

        def on_step(step: int, loss: float) -> None:
            step_at[0] = step
            progress.step(step, loss)

        def before_push(step: int) -> None:
            if args.rank == args.slow_rank and args.slow_ms > 0:
                time.sleep(args.slow_ms / 1000)

        summary = train(
            workload,
            client,
            steps=args.steps,
            batch_size=args.batch_size,
            optimizer=optimizer_spec(args.optimizer, args.lr, args.momentum),
            seed=args.seed,
            device=device,
            on_start=progress.start,
            on_step=on_step,
            before_push=before_push,
            metrics=metrics,
            overlap=args.overlap,
            elastic_lr=args.elastic_lr,
            curves=curves,
            init_from=args.init_from,
        )
    except Stopped as stop:
        progress.close()
        print(f"{me}: {stop} at step {step_at[0]}; leaving the shards", file=sys.stderr, flush=True)
        raise
    except PSError as exc:  # a shard's refusal names the shard; each says what to do
        progress.close()
        print(f"{me}: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        progress.close()
        print(f"{me}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError, ValueError, OSError) as exc:
        progress.close()
        print(f"{me}: {exc}", file=sys.stderr)
        return 1
    finally:
        curves.close()
        if client is not None:
            client.close()
        if endpoint is not None:
            endpoint.close()
        tracing.shutdown()  # the spans still queued go out
    progress.close()
    report = jsonout.finite_or_none({"workload": args.workload, "batch_size": args.batch_size, **summary.to_dict()})
    if args.events or args.json:  # the same last line either way: what containers' logs are read for
        print(jsonout.dumps({"event": "done", **report}), flush=True)
    else:
        print_summary(report, sys.stdout)
    return 0


class Progress:
    """One tqdm bar on stderr, from the first training step (so its rate leaves start-up out); none
    with ``--no-progress``, ``--events`` or when stderr is not a terminal. ``--events`` prints a JSON
    line per step (at most every 0.1 s, and the last) for ps-launch instead."""

    def __init__(self, args: Any, me: str) -> None:
        self.args = args
        self.me = me
        self.bar: Any = None
        self.last_event = 0.0
        self.show = not (args.no_progress or args.events) and sys.stderr.isatty()

    def start(self, first: int, steps: int) -> None:
        if self.args.events:
            print(jsonout.dumps({"event": "start", "rank": self.args.rank, "step": first}), flush=True)
        if self.show:
            from tqdm import tqdm

            self.bar = tqdm(
                total=steps, initial=first, desc=f"rank {self.args.rank}", unit="step", file=sys.stderr, leave=False
            )

    def step(self, step: int, loss: float) -> None:
        now = time.monotonic()
        if self.args.events and (now - self.last_event > 0.1 or step == self.args.steps):
            self.last_event = now
            print(jsonout.dumps({"event": "step", "rank": self.args.rank, "step": step, "loss": loss}), flush=True)
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


if __name__ == "__main__":
    sys.exit(main())
