"""The cost of ``DistributedOptimizer.clip_grad_norm_``: a sync step with and without the clip.

    python bench/clip_cost.py --width 256 --layers 2 --shards 2 --workers 2 --steps 30 --rounds 3

``--workers`` ranks (threads of this process) train the same MLP against ``--shards`` real shard
processes (sync mode), alternating rounds of plain steps (one PushPull per shard) and clipped steps
(a Push that waits for the round's norm, then a Pull that carries the coefficient), and rank 0
prints the median step of each and the difference: the price of the extra round trip.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from _common import Child, child_env, start_shards

from ps_worker import DistributedOptimizer, PSClient


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=30, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    env = child_env(1)
    log_dir = Path(tempfile.mkdtemp(prefix="grpc-ps-clip-"))
    shards: list[Child] = []
    samples: dict[bool, list[float]] = {False: [], True: []}
    mb = 0.0
    try:
        shards, servers = start_shards(args.shards, args.workers, env, log_dir)

        def rank(r: int) -> None:
            nonlocal mb
            torch.manual_seed(0)
            layers: list[torch.nn.Module] = []
            for _ in range(args.layers):
                layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
            model = torch.nn.Sequential(*layers)
            x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
            mb = sum(q.numel() * 4 for q in model.parameters()) / 1e6
            with PSClient(servers, r, args.workers, timeout=300) as client:
                client.init(model, {"name": "sgd", "lr": 1e-3})
                opt = DistributedOptimizer(model, client)
                for _ in range(args.rounds):
                    for clip in (False, True):
                        for i in range(args.steps + 1):  # the first is a warm-up
                            t0 = time.perf_counter()
                            opt.zero_grad()
                            torch.nn.functional.mse_loss(model(x), y).backward()
                            if clip:
                                opt.clip_grad_norm_(1.0)
                            opt.step()
                            if r == 0 and i:
                                samples[clip].append(time.perf_counter() - t0)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(args.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for c in shards:
            c.stop(grace=0.0)
    plain, clipped = (statistics.median(samples[c]) * 1000 for c in (False, True))
    print(f"model {mb:.2f} MB, {args.workers} workers x {args.shards} shards (sync)")
    print(f"step                      {plain:8.2f} ms (median of {len(samples[False])})")
    print(f"step with clip_grad_norm_ {clipped:8.2f} ms (median of {len(samples[True])})")
    print(f"clipping costs {clipped - plain:+.2f} ms per step ({clipped / plain:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
