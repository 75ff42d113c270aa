"""Dense training's step rate while clients loop large PullRows on the same shard.

Starts one ``ps-server`` (async, one worker) and a trainer process that declares a table of
``2**40`` rows of ``--dim`` float32 elements and trains a dense MLP through ``DistributedOptimizer``
for ``2 * --seconds``, stamping every step (``time.monotonic``, one clock for every process on
Linux). After ``--seconds`` it starts ``--pullers`` processes that each loop one PullRows of ``--ids``
ids (default 1.99M: 16 MB of ids, within the default ``--max-message-bytes``) until the end. It
prints the trainer's steps/s alone and under the pulls (the first 20 % of each window left out as
warm-up) and their ratio; the target is a ratio of at least 0.8 (a pull holds the shard's lock one
chunk of ``READ_CHUNK_IDS`` ids at a time, not for the whole pull)::

    python bench/table_pulls.py                     # 3 pullers x 1.99M ids, 10 s per window
    python bench/table_pulls.py --pullers 0         # the step rate alone, twice

Benchmarks are not tests (docs/architecture.md#11-benchmarks): this reports numbers, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TABLE_ROWS = 2**40


def trainer(args: argparse.Namespace) -> None:
    """Rank 0: declare the table, train the dense model ``2 * seconds``, print the step stamps."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from ps_common.tables import RowOptimizerSpec, TableSpec
    from ps_worker import DistributedOptimizer, PSClient

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    client = PSClient([args.server], rank=0, num_workers=1, timeout=60)
    client.init(model, {"name": "sgd", "lr": 0.01})
    client.init_tables([TableSpec("t", TABLE_ROWS, args.dim, RowOptimizerSpec("sgd", {"lr": 0.1}))])
    opt = DistributedOptimizer(model, client)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    print(json.dumps({"ready": True, "incarnation": client.session.incarnation}), flush=True)
    stamps = []
    end = time.monotonic() + 2 * args.seconds
    while time.monotonic() < end:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        stamps.append(time.monotonic())
    print(json.dumps({"stamps": stamps}), flush=True)
    client.close()


def puller(args: argparse.Namespace) -> None:
    """Loop one PullRows of ``args.ids`` sorted ids forever (killed by the parent)."""
    import grpc
    import numpy as np

    from ps_proto.v1 import ps_pb2, ps_pb2_grpc

    ids = np.sort(np.random.default_rng(args.rank).integers(0, TABLE_ROWS, args.ids)).astype("<i8")
    request = ps_pb2.PullRowsRequest(
        rank=0, incarnation=args.incarnation, blocks=[ps_pb2.RowBlock(table="t", ids=ids.tobytes())]
    )
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(args.server, options=options) as channel:
        stub = ps_pb2_grpc.ParameterServiceStub(channel)
        while True:
            stub.PullRows(request, timeout=60)


def rate(stamps: list[float], start: float, end: float) -> float:
    """Steps per second in ``[start + 20 % of the window, end)``."""
    begin = start + 0.2 * (end - start)
    inside = [s for s in stamps if begin <= s < end]
    return len(inside) / (end - begin)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pullers", type=int, default=3)
    p.add_argument("--ids", type=int, default=1_990_000, help="ids per PullRows")
    p.add_argument("--dim", type=int, default=1)
    p.add_argument("--seconds", type=float, default=10.0, help="length of each window")
    p.add_argument("--role", choices=["trainer", "puller"], help=argparse.SUPPRESS)
    p.add_argument("--server", default="", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--incarnation", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "trainer":
        trainer(args)
        return
    if args.role == "puller":
        puller(args)
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = [str(Path(sys.executable).parent / "ps-server"), "--shard-index", "0", "--num-shards", "1"]
    server += ["--num-workers", "1", "--mode", "async"]
    server += ["--port", "0", "--metrics-port", "-1"]
    shard = subprocess.Popen(server, stdout=subprocess.PIPE, text=True, env=env)
    children: list[subprocess.Popen] = []
    try:
        assert shard.stdout is not None
        address = ""
        deadline = time.monotonic() + 60
        while not address and time.monotonic() < deadline:
            line = shard.stdout.readline()
            if not line:
                raise RuntimeError(f"the shard exited: {shard.wait(5)}")
            if "listening on" in line:
                address = line.split("listening on ")[1].strip()
        me = [sys.executable, __file__, "--server", address, f"--seconds={args.seconds}", f"--dim={args.dim}"]
        train = subprocess.Popen([*me, "--role", "trainer"], stdout=subprocess.PIPE, text=True, env=env)
        children.append(train)
        assert train.stdout is not None
        ready = json.loads(train.stdout.readline())
        started = time.monotonic()
        time.sleep(args.seconds)  # the window alone (a benchmark's schedule, not a synchronization)
        loaded = time.monotonic()
        for r in range(args.pullers):
            argv = [*me, "--role", "puller", "--rank", str(r), "--ids", str(args.ids)]
            argv += ["--incarnation", str(ready["incarnation"])]
            children.append(subprocess.Popen(argv, env=env))
        out, _ = train.communicate(timeout=4 * args.seconds + 120)
        stamps = json.loads(out.strip().splitlines()[-1])["stamps"]
        alone = rate(stamps, started, loaded)
        under = rate(stamps, loaded, started + 2 * args.seconds)
    finally:
        for c in [*children, shard]:
            if c.poll() is None:
                c.kill()
                c.wait(30)
    print(
        f"dense steps/s alone: {alone:.1f}; with {args.pullers} clients looping PullRows of {args.ids} ids: "
        f"{under:.1f}; ratio {under / alone if alone else float('nan'):.3f} (target >= 0.8)"
    )
    print(
        json.dumps(
            {"alone_steps_per_s": alone, "under_pulls_steps_per_s": under, "ratio": under / alone if alone else None}
        )
    )


if __name__ == "__main__":
    main()
