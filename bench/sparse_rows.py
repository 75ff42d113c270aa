"""Row-sparse embedding tables on the wire: bytes per step against ids x dim x itemsize x 2.

Starts ``--shards`` ps-server processes and ``--workers`` worker processes on this machine; each
worker trains a model of one ``nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)`` built on the
meta device (never allocated: the table lives on the shards, each holding only the rows it owns
and that were updated) and a linear head, through ``DistributedOptimizer`` in ``--mode`` (sync by
default), ``--batch`` samples of ``--bag`` ids per step drawn uniformly from ``[0, rows)``.

Afterwards it reads the shards' byte counters (Prometheus ``ps_received_bytes_total`` and
``ps_sent_bytes_total`` of ``PullRows`` and ``PushRows``, both directions) and prints the measured
bytes per step against the formula ``distinct ids x dim x 4 x 2`` (rows pulled + row gradients
pushed; the ids themselves, 8 bytes each way, and protobuf framing are the difference), the
ratio, and every process's peak resident memory against the table's size::

    python bench/sparse_rows.py                      # 10M x 64 (2.56 GB), 2 workers x 2 shards, sync
    python bench/sparse_rows.py --rows 100000 --steps 20   # a quick look

Benchmarks are not tests (docs/architecture.md#11-benchmarks): this reports numbers, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def peak_rss_bytes(pid: int | str = "self") -> int:
    """VmHWM (peak resident set) of a process, bytes (Linux); 0 when unknown."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    m = re.search(r"VmHWM:\s+(\d+) kB", text)
    return int(m.group(1)) * 1024 if m else 0


def worker(args: argparse.Namespace) -> None:
    """One rank: train ``args.steps`` steps, print one JSON line of what it did."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from ps_worker import DistributedOptimizer, PSClient

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True, device="meta")
            self.head = nn.Linear(args.dim, 1)

        def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids, offsets)).squeeze(1)

    torch.manual_seed(0)
    model = Model()
    client = PSClient(args.servers.split(","), rank=args.rank, num_workers=args.workers, timeout=120)
    client.init(model, {"name": "sgd", "lr": 0.05, "sparse": {"name": args.optimizer, "lr": 0.05}})
    opt = DistributedOptimizer(model, client)
    gen = torch.Generator().manual_seed(1000 + args.rank)
    distinct = 0
    offsets = torch.arange(0, args.batch * args.bag, args.bag)
    start = time.perf_counter()
    for _ in range(args.steps):
        ids = torch.randint(0, args.rows, (args.batch * args.bag,), generator=gen)
        distinct += int(torch.unique(ids).numel())
        y = torch.randn(args.batch, generator=gen)
        opt.zero_grad()
        F.mse_loss(model(ids, offsets), y).backward()
        opt.step()
    seconds = time.perf_counter() - start
    tables = client.tables
    assert tables is not None
    print(
        json.dumps(
            {
                "rank": args.rank,
                "distinct_ids": distinct,
                "seconds": seconds,
                "peak_rss": peak_rss_bytes(),
                "payload_sent": tables.sent_bytes,
                "payload_received": tables.received_bytes,
            }
        ),
        flush=True,
    )
    client.close()


def scrape(url: str) -> dict[tuple[str, str], float]:
    """``{(metric, method): value}`` of the byte counters at a shard's /metrics."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = re.match(r'(ps_(?:received|sent)_bytes_total)\{method="ps\.v1\.ParameterService/(\w+)"\} (\S+)', line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
        m = re.match(r'ps_table_rows\{table="[^"]+"\} (\S+)', line)
        if m:
            out[("rows", "")] = out.get(("rows", ""), 0.0) + float(m.group(1))
    return out


def start_shards(args: argparse.Namespace) -> tuple[list[subprocess.Popen], list[str], list[str]]:
    procs, addresses, metrics = [], [], []
    server = str(Path(sys.executable).parent / "ps-server")
    for k in range(args.shards):
        cmd = [server, "--shard-index", str(k), "--num-shards", str(args.shards), "--num-workers", str(args.workers)]
        cmd += ["--mode", args.mode, "--port", "0", "--metrics-port", "0", "--max-table-rows", str(args.rows)]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"shard {k} exited: {p.wait(5)}")
            if "metrics on" in line:
                metrics.append(line.split("metrics on ")[1].strip())
            if "listening on" in line:
                addresses.append(line.split("listening on ")[1].strip())
                break
    return procs, addresses, metrics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=512, help="samples per worker step")
    p.add_argument("--bag", type=int, default=8, help="ids per sample")
    p.add_argument("--mode", default="sync")
    p.add_argument("--optimizer", default="adagrad", choices=["sgd", "adagrad", "adam"])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--servers", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    shards, addresses, metrics = start_shards(args)
    try:
        base = [scrape(u) for u in metrics]
        started = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        workers = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", "--rank", str(r), "--servers", ",".join(addresses)]
                + [
                    f"--{k}={getattr(args, k)}"
                    for k in ("rows", "dim", "workers", "steps", "batch", "bag", "optimizer")
                ],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for r in range(args.workers)
        ]
        reports = []
        for w in workers:
            out, _ = w.communicate(timeout=1800)
            if w.returncode:
                raise RuntimeError(f"a worker failed ({w.returncode})")
            reports.append(json.loads(out.strip().splitlines()[-1]))
        wall = time.perf_counter() - started
        after = [scrape(u) for u in metrics]
        shard_rss = [peak_rss_bytes(s.pid) for s in shards]
    finally:
        for s in shards:
            s.terminate()
        for s in shards:
            s.wait(30)
    report(args, reports, base, after, shard_rss, wall)


def report(args, reports, base, after, shard_rss, wall) -> None:
    def total(metric: str, method: str) -> float:
        return sum(
            a.get((metric, method), 0.0) - b.get((metric, method), 0.0) for a, b in zip(after, base, strict=True)
        )

    moved = {
        m: total("ps_received_bytes_total", m) + total("ps_sent_bytes_total", m)
        for m in ("InitTables", "PullRows", "PushRows")
    }
    distinct = sum(r["distinct_ids"] for r in reports)
    steps = args.steps
    measured = (moved["PullRows"] + moved["PushRows"]) / steps
    formula = distinct * args.dim * 4 * 2 / steps
    table_bytes = args.rows * args.dim * 4
    worker_rss = [r["peak_rss"] for r in reports]
    print(
        f"table {args.rows} x {args.dim} float32 = {table_bytes / 1e9:.2f} GB; "
        f"{args.workers} workers x {args.shards} shards, "
        f"{args.mode}, {args.optimizer}, {steps} steps of {args.batch} x {args.bag} ids per worker"
    )
    print(f"distinct ids per step (all workers): {distinct / steps:.0f}")
    print(f"measured bytes per step (shards' counters, PullRows + PushRows, both directions): {measured:,.0f}")
    print(f"formula ids x dim x 4 x 2:                                               {formula:,.0f}")
    print(
        f"ratio measured / formula: {measured / formula:.4f}  "
        f"(ids 8 B each way: +{16 / (args.dim * 8):.2%}, rest framing)"
    )
    print(f"rows held on the shards after training: {sum(a.get(('rows', ''), 0.0) for a in after):,.0f}")
    print(
        f"peak RSS: shards {[f'{b / 1e9:.2f} GB' for b in shard_rss]}, workers "
        f"{[f'{rss / 1e9:.2f} GB' for rss in worker_rss]} (the table: {table_bytes / 1e9:.2f} GB)"
    )
    print(f"steps/s per worker: {[round(steps / r['seconds'], 2) for r in reports]}; wall {wall:.1f} s")
    print(
        json.dumps(
            {
                "measured_bytes_per_step": measured,
                "formula_bytes_per_step": formula,
                "ratio": measured / formula,
                "shard_peak_rss": shard_rss,
                "worker_peak_rss": [r["peak_rss"] for r in reports],
                "table_bytes": table_bytes,
            }
        )
    )


if __name__ == "__main__":
    main()
