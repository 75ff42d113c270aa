"""One training script, run under torch DDP (gloo) or grpc-ps sync mode, to compare the two.

A CNN with BatchNorm; SGD with momentum and weight decay on weights only; a LambdaLR warm-up +
cosine schedule; accumulation over K micro-batches (DDP: ``no_sync()`` on all but the last);
clipping of the local gradients; optionally a GradScaler with an overflow forced on rank 1.

DDP rank (a subprocess): ``python -m tests.helpers.ddp_script RANK PORT OUT [--amp]``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F

STEPS = 50
K = 2
BATCH = 4
WORLD = 2
OVERFLOW_STEP = 7
MAX_NORM = 100.0
"""Local clipping threshold (the script clips every step; see ``train``'s returned norms)."""
NO_DECAY = ["0.bias", "1.weight", "1.bias", "4.bias"]
OPTIMIZER = {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}


def cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 3),
    )


def schedule(step: int, warmup: int = 5) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (STEPS - warmup)))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    n = STEPS * K * WORLD * BATCH
    return torch.randn(n, 1, 6, 6, generator=g) * 2 + 0.5, torch.randint(0, 3, (n,), generator=g)


def train(
    rank: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    scaler: Any | None,
    no_sync: Callable[[], Any] | None = None,
) -> float:
    """The loop both runs share; returns the largest local gradient norm seen (finite steps)."""
    x, y = data()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    largest = 0.0
    for t in range(STEPS):
        opt.zero_grad()
        for j in range(K):
            lo = ((t * K + j) * WORLD + rank) * BATCH
            ctx = no_sync() if no_sync is not None and j < K - 1 else contextlib.nullcontext()
            with ctx:
                loss = F.cross_entropy(model(x[lo : lo + BATCH]), y[lo : lo + BATCH]) / K
                if scaler is not None and t == OVERFLOW_STEP and rank == 1 and j == 0:
                    loss = loss * float("inf")
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        largest = max(largest, norm) if math.isfinite(norm) else largest
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
    return largest


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    named = dict(model.named_parameters())
    return [
        {"params": [p for k, p in named.items() if k not in NO_DECAY]},
        {"params": [named[k] for k in NO_DECAY], "weight_decay": 0.0},
    ]


def server_optimizer() -> dict[str, Any]:
    return {"name": "sgd", **OPTIMIZER, "groups": [{"params": NO_DECAY, "weight_decay": 0.0}]}


def ddp_rank(rank: int, port: int, out: str, amp: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        model = cnn()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(param_groups(model), **OPTIMIZER)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if amp else None
        largest = train(rank, ddp, opt, scaler, ddp.no_sync)
        extra = {"scale": scaler.get_scale() if scaler else None, "largest_norm": largest}
        torch.save({"state": model.state_dict(), **extra}, out)
        # both ranks done with gloo before either leaves; then leave without running gloo's C++
        # destructors: tearing the group down (destroy_process_group, or the interpreter's exit) while
        # a pair thread still runs aborts now and then ("terminate called without an active
        # exception", exit -6), after the result above was written
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("out")
    parser.add_argument("--amp", action="store_true")
    a = parser.parse_args()
    ddp_rank(a.rank, a.port, a.out, a.amp)
