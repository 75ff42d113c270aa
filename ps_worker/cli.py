"""``ps-worker``: train a built-in workload through a grpc-ps cluster as one rank."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Mapping, Sequence

import grpc
import torch
from prometheus_client import CollectorRegistry

from ps_server.channels import tls_flags
from ps_server.core.errors import PSError
from ps_server.flags import FlagParser, secret
from ps_server.metrics import serve_metrics
from ps_worker.client import PSClient
from ps_worker.errors import ShardError
from ps_worker.metrics import WorkerMetrics
from ps_worker.train import train
from ps_worker.workloads import WORKLOADS, get_workload

log = logging.getLogger("ps_worker")


def ratio(text: str) -> float:
    """A fraction in [0, 1] (argparse type).

    Raises:
        argparse.ArgumentTypeError: not a number in [0, 1].
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1]")
    return value


def training_flags(p: FlagParser) -> None:
    """The training flags, shared by ``ps-worker`` and ``ps-launch`` (which forwards them)."""
    p.flag("--steps", type=int, default=300, help="optimizer steps (pushes) to run")
    p.flag("--batch-size", type=int, default=32, help="samples per step on this worker")
    p.flag(
        "--optimizer",
        default="sgd",
        choices=("sgd", "adam", "adamw", "adagrad", "rmsprop"),
        help="server-side torch.optim optimizer (sent by rank 0 at Init)",
    )
    p.flag("--lr", type=float, default=0.1, help="learning rate")
    p.flag("--momentum", type=float, default=0.9, help="momentum (sgd, rmsprop)")
    p.flag("--seed", type=int, default=0, help="seed of model initialization and data shuffling")
    p.flag("--slow-rank", type=int, default=-1, help="rank that sleeps --slow-ms before every push (straggler)")
    p.flag("--slow-ms", type=float, default=0.0, help="milliseconds the slow rank sleeps before each push")
    p.flag("--corpus", default="", help="charlm: text file to train on (default: the Python standard library's source)")
    p.flag(
        "--wire-dtype",
        default="native",
        choices=("native", "bfloat16", "float16"),
        help="dtype of gradients and weights on the wire: native (each parameter's own) or bfloat16/float16 "
        "(half the bytes of float32; shards keep float32 weights and optimizer state)",
    )
    p.flag(
        "--overlap",
        switch=True,
        help="push each layer's gradient while the rest of backward runs (sync, async, ssp)",
    )
    p.flag(
        "--topk",
        type=ratio,
        default=0.0,
        help="push only this fraction of each gradient partition, the largest entries, and keep the rest for "
        "later pushes (error feedback, Stich et al. 2018); 0 pushes dense gradients",
    )


def worker_parser(environ: Mapping[str, str] | None = None) -> FlagParser:
    """The ``ps-worker`` flags (DESIGN section 10)."""
    p = FlagParser(
        prog="ps-worker", description="Train a built-in workload as one rank of a grpc-ps cluster.", environ=environ
    )
    p.flag("--servers", required=True, help="HOST:PORT of every shard, comma-separated, in shard-index order")
    p.flag("--rank", type=int, required=True, help="this worker's rank, 0..num_workers-1")
    p.flag("--num-workers", type=int, required=True, help="number of worker ranks")
    training_flags(p)
    p.flag("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when available)")
    p.flag("--timeout", type=float, default=60.0, help="per-RPC deadline in seconds (a sync pull waits this long)")
    p.flag("--incarnation", type=int, default=None, help="restart counter of this rank (default: wall-clock µs)")
    p.flag(
        "--retry-deadline",
        type=float,
        default=30.0,
        help="seconds to keep retrying an unreachable shard (backoff with jitter) before failing",
    )
    p.flag("--token", default="", help="bearer token for ParameterService")
    p.flag("--token-file", default="", help="file holding the bearer token (e.g. a mounted Secret)")
    tls_flags(p)
    p.flag(
        "--metrics-port",
        type=int,
        default=8000,
        help="HTTP port of Prometheus /metrics; 0 picks a free port (several workers on one host), -1 turns it off",
    )
    p.flag("--metrics-host", default="127.0.0.1", help="address /metrics binds (0.0.0.0 to be scraped from outside)")
    p.flag("--events", switch=True, help="print one JSON object per step on stdout (used by ps-launch)")
    p.flag("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log level")
    p.add_argument(
        "workload",
        nargs="?",
        default=p.environ.get("PS_WORKLOAD", "digits"),
        choices=sorted(WORKLOADS),
        help="built-in workload [env PS_WORKLOAD]",
    )
    return p


def optimizer_spec(name: str, lr: float, momentum: float) -> dict[str, float | str]:
    """The optimizer spec a rank-0 worker sends at Init."""
    spec: dict[str, float | str] = {"name": name, "lr": lr}
    if name in ("sgd", "rmsprop") and momentum:
        spec["momentum"] = momentum
    return spec


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; prints the summary as one JSON object on the last line of stdout."""
    parser = worker_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not 0 <= args.rank < args.num_workers:
        parser.error(f"--rank must be in 0..{args.num_workers - 1}, got {args.rank}.")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if not -1 <= args.metrics_port <= 65535:
        parser.error(f"--metrics-port must be in -1..65535 (-1: off), got {args.metrics_port}.")
    try:
        workload = get_workload(args.workload, corpus=args.corpus)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    last_event = 0.0
    metrics, endpoint = None, None
    if args.metrics_port >= 0:
        metrics = WorkerMetrics(CollectorRegistry())
        try:
            endpoint = serve_metrics(metrics.registry, args.metrics_host, args.metrics_port)
        except RuntimeError as exc:
            print(f"ps-worker rank {args.rank}: {exc}", file=sys.stderr)
            return 1
        print(f"ps-worker rank {args.rank}: metrics on {endpoint.url}", file=sys.stderr, flush=True)
        if args.events:
            print(json.dumps({"event": "metrics", "rank": args.rank, "url": endpoint.url}), flush=True)

    def on_step(step: int, loss: float) -> None:
        nonlocal last_event
        now = time.monotonic()
        if args.events and (now - last_event > 0.1 or step == args.steps):
            last_event = now
            print(json.dumps({"event": "step", "rank": args.rank, "step": step, "loss": loss}), flush=True)

    def before_push(step: int) -> None:
        if args.rank == args.slow_rank and args.slow_ms > 0:
            time.sleep(args.slow_ms / 1000)

    try:
        token = secret(args.token, args.token_file, "--token")
    except ValueError as exc:
        parser.error(str(exc))
    client = PSClient(
        servers,
        args.rank,
        args.num_workers,
        incarnation=args.incarnation,
        token=token or None,
        timeout=args.timeout,
        retry_deadline=args.retry_deadline,
        tls_ca=args.tls_ca or None,
        tls_cert=args.tls_cert or None,
        tls_key=args.tls_key or None,
        metrics=metrics,
        wire_dtype=None if args.wire_dtype == "native" else args.wire_dtype,
        topk=args.topk,
    )
    try:
        summary = train(
            workload,
            client,
            steps=args.steps,
            batch_size=args.batch_size,
            optimizer=optimizer_spec(args.optimizer, args.lr, args.momentum),
            seed=args.seed,
            device=device,
            on_step=on_step,
            before_push=before_push,
            metrics=metrics,
            overlap=args.overlap,
        )
    except ShardError as exc:  # names the shard, and what to do
        print(f"ps-worker rank {args.rank}: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"ps-worker rank {args.rank}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (PSError, RuntimeError, TimeoutError) as exc:
        print(f"ps-worker rank {args.rank}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
        if endpoint is not None:
            endpoint.close()
    print(json.dumps({"event": "done", **summary.to_dict()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
