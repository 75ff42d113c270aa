"""A DLRM-style model's training step under grpc-ps against the same script under DDP (gloo).

    python bench/embedding_step.py --workers 2 --shards 2 --steps 300 --rounds 2

The model is the ``ctr`` workload's DLRM (``ps_worker.workloads.ctr``; Naumov et al. 2019) on a
click log of 4 Zipf-distributed fields (61,000 rows of 16 float32 over 4 ``EmbeddingBag`` tables,
``sparse=True``), batch 256 per rank, Adagrad (lr 0.05) on every parameter, the rows included.

Systems, each a set of real processes started here and stopped by their PIDs:

- ``ddp``: one process per rank, ``DistributedDataParallel`` over gloo on 127.0.0.1; every rank
  holds the whole tables and all-reduces their sparse gradients; ``torch.optim.Adagrad`` steps.
- ``grpc-ps``: ``--shards`` ``ps-server`` processes (sync) and one process per rank with
  ``PSClient`` + ``DistributedOptimizer``: the tables live on the shards, a forward pulls its
  batch's rows, ``opt.step()`` pushes their gradients and then the dense PushPull.
- ``grpc-ps-prefetch``: the same, with the next batch's rows prefetched
  (``ps_worker.tables.RowPrefetcher``): ``opt.step()`` sends the next batch's ids with the push, and
  the shards answer the rows of the round the push completes, so a forward never waits for a pull.

Each rank times every step (data, forward, backward, ``opt.step()``); the table gives rank 0's
median over the steps after the first ``--warmup`` of every round, and the ratio to DDP's. The
runs alternate (A B C A B C ...). Benchmarks, not tests: read the ratios of one run on a quiet
machine (the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import Child, ChildError, child_env, free_port, start_shards, stop_all

SYSTEMS = ("ddp", "grpc-ps", "grpc-ps-prefetch")
ATTEMPTS = 3
"""Runs of a system before the benchmark gives up: DDP's ranks with sparse gradients over gloo die
now and then by SIGABRT in torch (``malloc(): unaligned tcache chunk detected``: about one run in
five here); every failure is printed."""
CARDINALITIES = (40_000, 15_000, 5_000, 1_000)
"""Distinct ids per field: 61,000 rows (plus one unknown-id row per table)."""


def clicklog_config() -> Any:
    from ps_worker.workloads.clicklog import ClickLogConfig

    return ClickLogConfig(
        cardinalities=CARDINALITIES,
        zipf_exponents=(1.2, 1.2, 1.1, 1.2),
        id_scales=(0.1, 0.15, 0.3, 0.5),
        pairs=((2, 3),),
    )


def rank_main(args: argparse.Namespace) -> int:
    """One rank of ``args.system``: train ``args.steps`` steps, print one JSON line of step times."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from ps_worker.workloads.clicklog import generate
    from ps_worker.workloads.ctr import ClickLogDataset, CTRWorkload

    torch.set_num_threads(1)
    torch.manual_seed(0)
    work = CTRWorkload(clicklog_config(), train_size=args.workers * args.batch * args.steps, held_out_size=2)
    model = work.model()
    data = ClickLogDataset(generate(work.clicklog, work.train_size, stream=0))
    sampler = DistributedSampler(data, num_replicas=args.workers, rank=args.rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)
    prefetcher = None
    if args.system == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.workers
        )
        net: torch.nn.Module = DistributedDataParallel(model)
        opt: Any = torch.optim.Adagrad(net.parameters(), lr=0.05)
        client = None
    else:
        from ps_worker import DistributedOptimizer, PSClient

        client = PSClient(args.servers.split(","), args.rank, args.workers, timeout=300)
        client.init(model, {"name": "adagrad", "lr": 0.05})
        net = model
        opt = DistributedOptimizer(model, client)
        if args.system == "grpc-ps-prefetch":
            from ps_worker.tables import RowPrefetcher

            prefetcher = RowPrefetcher(client, lambda batch: model.table_inputs(batch[0]))
            loader = prefetcher.wrap(loader)  # type: ignore[assignment]
    times: list[float] = []
    t0 = time.perf_counter()
    for x, y in loader:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(net(x), y)
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    out: dict[str, Any] = {"rank": args.rank, "times": times, "loss": float(loss)}
    if client is not None:
        out["calls"] = dict(client.tables.calls) if client.tables is not None else {}
        client.close()
    else:
        import torch.distributed as dist

        dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    return 0


def run_system(system: str, args: argparse.Namespace, env: dict[str, str], log_dir: Path) -> list[float]:
    """One run of ``system``: rank 0's step times, seconds."""
    shards: list[Child] = []
    ranks: list[Child] = []
    try:
        servers: list[str] = []
        if system != "ddp":
            shards, servers = start_shards(args.shards, args.workers, env, log_dir)
        port = free_port()
        for r in range(args.workers):
            argv = [sys.executable, __file__, "--rank-of", system, "--rank", str(r), "--port", str(port)]
            argv += ["--servers", ",".join(servers) or "-", "--workers", str(args.workers)]
            argv += ["--batch", str(args.batch), "--steps", str(args.steps)]
            ranks.append(Child(f"{system}-rank{r}", argv, env, log_dir))
        answers = [c.recv(args.timeout, "run") for c in ranks]
        return [float(t) for t in answers[0]["times"]]
    finally:
        stop_all(ranks + shards)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"some of {', '.join(SYSTEMS)}")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--batch", type=int, default=256, help="per rank")
    p.add_argument("--steps", type=int, default=300, help="steps per rank and run")
    p.add_argument("--warmup", type=int, default=20, help="steps of each run left out of the median")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    p.add_argument("--json", type=Path, help="also write every step time here")
    p.add_argument("--rank-of", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--servers", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_of:
        args.system = args.rank_of
        return rank_main(args)
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or args.steps <= args.warmup:
        p.error(f"unknown systems {unknown}" if unknown else "--steps must exceed --warmup")
    env = child_env(1)
    log_dir = Path(tempfile.mkdtemp(prefix="grpc-ps-embedding-"))
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; logs in {log_dir}")
    samples: dict[str, list[float]] = {s: [] for s in systems}
    for _ in range(args.rounds):
        for s in systems:
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    samples[s] += run_system(s, args, env, log_dir)[args.warmup :]
                    break
                except ChildError as exc:
                    print(f"{s}: run {attempt} of {ATTEMPTS} failed: {exc} (see {log_dir})", file=sys.stderr)
                    if attempt == ATTEMPTS:
                        return 1
    ref = statistics.median(samples["ddp"]) if samples.get("ddp") else None
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"{args.workers} ranks, batch {args.batch} per rank, {args.shards} shards, "
        f"{args.rounds} runs of {args.steps} steps"
    )
    print("| system | median step, ms | p10-p90, ms | / ddp |\n|---|---:|---:|---:|")
    for s, xs in samples.items():
        xs = sorted(xs)
        med = statistics.median(xs)
        p10, p90 = xs[len(xs) // 10], xs[(9 * len(xs)) // 10]
        ratio = f"{med / ref:.2f}x" if ref else "-"
        print(f"| {s} | {med * 1e3:.2f} | {p10 * 1e3:.2f}-{p90 * 1e3:.2f} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "samples": samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
