"""Pushes overlapped with backward (``DistributedOptimizer(overlap=True)``) against pushes after it.

    python bench/overlap.py --width 1024 --layers 6 --shards 2 --steps 20 --rounds 5

One worker (this process) trains an MLP of ``--layers`` square ``--width`` layers (float32) on
random data against ``--shards`` real shard processes (sync mode), alternating rounds with and
without overlap on the same client, and prints the median step (forward + backward + step) of each
and their ratio. Overlap can only hide the upload of the last layers' gradients behind the backward
of the first ones, so it helps when backward and push take comparable time and there are cores
for both; on a 2-core machine that also runs the shards, expect little.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import Child, child_env, start_shards

from ps_worker import DistributedOptimizer, PSClient


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    env = child_env(1)
    log_dir = Path(tempfile.mkdtemp(prefix="grpc-ps-overlap-"))
    shards: list[Child] = []
    try:
        shards, servers = start_shards(args.shards, 1, env, log_dir)
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
        model = torch.nn.Sequential(*layers)
        x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
        mb = sum(q.numel() * 4 for q in model.parameters()) / 1e6
        with PSClient(servers, 0, 1, timeout=300) as client:
            client.init(model, {"name": "sgd", "lr": 1e-4})
            opt = DistributedOptimizer(model, client, overlap=True)

            def step() -> None:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()

            samples: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.rounds):
                for overlap in (False, True):
                    opt.overlap = overlap
                    step()  # warm-up
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        step()
                        samples[overlap].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
            compute = (time.perf_counter() - t0) / args.steps
        after, during = (statistics.median(samples[o]) * 1000 for o in (False, True))
        print(f"model {mb:.1f} MB, {args.shards} shards; forward+backward alone {compute * 1000:.1f} ms")
        print(f"step with pushes after backward   {after:8.1f} ms (median of {len(samples[False])})")
        print(f"step with pushes during backward  {during:8.1f} ms (median of {len(samples[True])})")
        print(f"overlap / after: {during / after:.2f}")
    finally:
        for c in shards:
            c.stop(grace=0.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
