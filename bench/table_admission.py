"""Embedding tables that follow the live ids: memory under admission and expiry, and the ctr model's AUC.

Two measurements (bench/README.md#tables-that-follow-the-live-ids):

1. **Memory** (``--part memory``): a stream of ``--ids`` (10M) Zipf(``--zipf``, 1.1) ids (numpy,
   seeded), ``--batch`` ids per step, pushed through one shard's table store **in process**
   (``ps_server.tables.store.TableStore``, the object a shard serves; gRPC is left out so that 10M ids
   take a minute, not an hour) with ``admit_after=--admit`` and ``expire_after_rounds=--expire``, the
   shard's timer played by a bounded ``expire()`` sweep every ``--tick`` steps. Every ``--sample`` steps
   it compares the table's bytes (its capacity: values, optimizer state, ids and index) and the
   admission filter's bytes with the bytes of the **live rows**: the rows an exact filter would hold,
   ids pushed in at least ``admit_after`` steps with no gap longer than the expiry window between
   them, and pushed within the last ``expire_after_rounds`` steps (computed exactly beside the stream
   with numpy). The looser count, ids pushed >= k times within the last T steps, is printed too.
2. **AUC** (``--part auc``): the ``ctr`` workload (``ps_worker.workloads.ctr``, the DLRM on the
   synthetic click log) trained through real shards (``--shards`` in-process gRPC servers on
   127.0.0.1, one worker, sync, Adagrad as ``tests/e2e/test_ctr.py``) without and with
   admission and expiry on its tables; prints both held-out AUCs and the difference.

    python bench/table_admission.py                          # both parts
    python bench/table_admission.py --part memory --ids 1000000   # a quick look

Benchmarks are not tests (docs/architecture.md#11-benchmarks): this reports numbers, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def memory(args: argparse.Namespace) -> dict:
    """Part 1: stream ids through a TableStore; table and filter bytes against the live rows'."""
    from ps_common.tables import RowOptimizerSpec, TableSpec
    from ps_server.policy import POLICIES
    from ps_server.tables.store import TableStore
    from ps_server.tables.table import RowGrads, table_row_bytes

    rng = np.random.default_rng(args.seed)
    raw = rng.zipf(args.zipf, size=args.ids)
    ids_all = (raw - 1) % (2**40)  # ranks 1.. -> ids 0..; the tail wraps into a 2^40 id space
    spec = TableSpec(
        "emb", 2**40, args.dim, RowOptimizerSpec("adagrad", {"lr": 0.05}),
        admit_after=args.admit, expire_after_rounds=args.expire,
    )  # fmt: skip
    store = TableStore(0, 1, max_rows=10**9, max_bytes=args.shard_bytes)
    store.declare([spec])
    table = store.table("emb")
    row = table_row_bytes(spec)
    # the exact reference, over dense indices of the stream's distinct ids
    uniq, inverse = np.unique(ids_all, return_inverse=True)
    n = uniq.size
    last = np.full(n, -(10**9), dtype=np.int64)  # last step pushed
    count = np.zeros(n, dtype=np.int64)  # pushes counted towards admission (exact filter)
    stored = np.zeros(n, dtype=bool)
    recent = []  # per step: the distinct dense ids (for the "pushed >= k times in the last T" count)
    samples, steps = [], args.ids // args.batch
    grads_cache = torch.ones(args.batch, args.dim) * 1e-3
    start = time.perf_counter()
    for step in range(steps):
        lo, hi = step * args.batch, (step + 1) * args.batch
        ids = torch.from_numpy(ids_all[lo:hi])
        store.push(POLICIES["async"], 0, 1, step, {"emb": RowGrads(ids, grads_cache[: hi - lo])})
        u = np.unique(inverse[lo:hi])
        gap_ok = step - last[u] <= args.expire  # exact filter: counts restart after a gap over the window
        count[u] = np.where(stored[u], count[u], np.where(gap_ok, count[u] + 1, 1))
        stored[u] |= count[u] >= args.admit
        last[u] = step
        recent.append(u)
        if len(recent) > args.expire:
            recent.pop(0)
        if step % args.tick == 0:
            store.expire()  # the shard's timer: a bounded sweep
            expired = stored & (step + 1 - last > args.expire)
            stored &= ~expired
            count[expired] = 0
        if (step + 1) % args.sample == 0 or step == steps - 1:
            in_window = np.unique(np.concatenate(recent), return_counts=True)
            live = int((stored & (step + 1 - last <= args.expire)).sum())
            samples.append(
                {
                    "step": step + 1,
                    "rows_held": table.rows,
                    "live_rows": live,
                    "looser_live_rows": int((in_window[1] >= args.admit).sum()),
                    "table_bytes": table.num_bytes,
                    "held_bytes": table.rows * row,
                    "filter_bytes": table.life.filter_bytes,
                    "live_bytes": live * row,
                    "admitted": table.life.admitted,
                    "expired": table.life.evicted["expired"],
                }
            )
            s = samples[-1]
            print(
                f"step {s['step']:>6}: {s['rows_held']:>9,} rows held, live {live:>9,}; table/live "
                f"{s['table_bytes'] / max(1, s['live_bytes']):.3f}, +filter "
                f"{(s['table_bytes'] + s['filter_bytes']) / max(1, s['live_bytes']):.3f} "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    worst = max(s["table_bytes"] / max(1, s["live_bytes"]) for s in samples[len(samples) // 4 :])
    worst_f = max(
        (s["table_bytes"] + s["filter_bytes"]) / max(1, s["live_bytes"]) for s in samples[len(samples) // 4 :]
    )
    return {
        "ids": args.ids,
        "distinct_ids": int(n),
        "batch": args.batch,
        "steps": steps,
        "seconds": round(time.perf_counter() - start, 1),
        "row_bytes": row,
        "worst_ratio_after_warmup": round(worst, 3),
        "worst_ratio_with_filter_after_warmup": round(worst_f, 3),
        "final": samples[-1],
    }


def auc(args: argparse.Namespace) -> dict:
    """Part 2: the ctr workload through real shards, without and with admission and expiry."""
    from ps_server.config import ServerConfig
    from ps_server.server import start_server
    from ps_worker import PSClient
    from ps_worker.workloads.ctr import CTRWorkload
    from ps_worker.workloads.train import train

    out = {}
    configs = {
        "off": {},
        "on": {"admit_after": args.admit, "expire_after_rounds": args.ctr_expire},
        "admission": {"admit_after": args.admit},
        "expiry": {"expire_after_rounds": args.ctr_expire},
    }
    for label in args.ctr_configs.split(","):
        options = configs[label]
        servers = [
            start_server(
                ServerConfig(shard_index=k, num_shards=args.shards, num_workers=1, mode="sync", port=0, metrics_port=-1)
            )
            for k in range(args.shards)
        ]
        try:
            workload = CTRWorkload(train_size=args.ctr_train, table_options=options)
            with PSClient([s.address for s in servers], rank=0, num_workers=1, timeout=60) as client:
                t0 = time.perf_counter()
                summary = train(
                    workload, client, steps=args.ctr_steps, batch_size=args.ctr_batch,
                    optimizer={"name": "adagrad", "lr": 0.05},
                )  # fmt: skip
            tables = [t for s in servers for t in s.shard.tables.tables.values()]
            out[label] = {
                "auc": summary.auc,
                "ground_truth_auc": summary.ground_truth_auc,
                "seconds": round(time.perf_counter() - t0, 1),
                "rows_held": sum(t.rows for t in tables),
                "rows_admitted": sum(t.life.admitted for t in tables),
                "rows_expired": sum(t.life.evicted["expired"] for t in tables),
            }
            print(f"ctr, admission/expiry {label}: {out[label]}", flush=True)
        finally:
            for s in servers:
                s.stop(grace=0.2)
    for label in out.keys() - {"off"}:
        if "off" in out:
            out[label]["auc_difference"] = round(out[label]["auc"] - out["off"]["auc"], 4)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("memory", "auc", "both"), default="both")
    p.add_argument("--ids", type=int, default=10_000_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--admit", type=int, default=2)
    p.add_argument("--expire", type=int, default=200, help="expire_after_rounds of the memory stream")
    p.add_argument("--tick", type=int, default=10, help="steps between timer sweeps")
    p.add_argument("--sample", type=int, default=100)
    p.add_argument("--shard-bytes", type=int, default=256 * 1024**2, help="the shard's --max-table-bytes")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--ctr-steps", type=int, default=800)
    p.add_argument("--ctr-batch", type=int, default=1024)
    p.add_argument("--ctr-train", type=int, default=1_000_000)
    p.add_argument("--ctr-expire", type=int, default=200)
    p.add_argument(
        "--ctr-configs", default="off,on", help="of off, on (admission and expiry), admission, expiry; comma-separated"
    )
    p.add_argument("--json", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    result = {"load_average": os.getloadavg()}
    if args.part in ("memory", "both"):
        result["memory"] = memory(args)
    if args.part in ("auc", "both"):
        result["auc"] = auc(args)
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
