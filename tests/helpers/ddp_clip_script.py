"""A nanoGPT-like training loop, run under torch DDP (gloo) or grpc-ps sync mode, to compare clipping.

A tiny next-token model (embedding, LayerNorm, MLP, head); AdamW with nanoGPT's decay groups (every
2-D parameter decays, biases and LayerNorm do not); accumulation over K micro-batches (DDP:
``no_sync()`` on all but the last); a LambdaLR warm-up + cosine schedule; the averaged gradient
clipped at 1.0, which cuts on most steps.

DDP rank (a subprocess): ``python -m tests.helpers.ddp_clip_script RANK PORT OUT``.
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

STEPS = 10
K = 2
BATCH = 4
SEQ = 6
VOCAB = 16
WORLD = 2
MAX_NORM = 1.0
LR = 3e-2
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, 16),
        torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, VOCAB),
    )


def no_decay(m: torch.nn.Module) -> list[str]:
    """nanoGPT's rule: parameters of fewer than 2 dimensions (biases, LayerNorm) do not decay."""
    return [k for k, p in m.named_parameters() if p.dim() < 2]


def torch_optimizer(m: torch.nn.Module) -> torch.optim.AdamW:
    """nanoGPT's ``configure_optimizers``: two groups by parameter identity."""
    nd = set(no_decay(m))
    groups = [
        {"params": [p for k, p in m.named_parameters() if k not in nd], "weight_decay": WEIGHT_DECAY},
        {"params": [p for k, p in m.named_parameters() if k in nd], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS)


def schedule(step: int, warmup: int = 3) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (STEPS - warmup)))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    n = STEPS * K * WORLD * BATCH
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train(
    rank: int,
    net: torch.nn.Module,
    opt: torch.optim.Optimizer,
    clip: Callable[[], torch.Tensor],
    no_sync: Callable[[], Any] | None = None,
) -> list[float]:
    """The loop both runs share; returns every step's total norm as ``clip()`` reported it."""
    x, y = data()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    norms = []
    for t in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for j in range(K):
            lo = ((t * K + j) * WORLD + rank) * BATCH
            ctx = no_sync() if no_sync is not None and j < K - 1 else contextlib.nullcontext()
            with ctx:
                logits = net(x[lo : lo + BATCH])
                # per sequence (summed over its tokens), so that the gradient's norm is above 1
                target = y[lo : lo + BATCH].reshape(-1)
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), target, reduction="sum") / (BATCH * K)
                loss.backward()
        norms.append(float(clip()))
        opt.step()
        sched.step()
    return norms


def ddp_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        net = model()
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch_optimizer(net)
        norms = train(rank, ddp, opt, lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM), ddp.no_sync)
        torch.save({"state": net.state_dict(), "norms": norms, "optimizer": opt.state_dict()}, out)
        dist.barrier()  # both ranks done with gloo; then leave without gloo's destructors (see ddp_script)
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
    a = parser.parse_args()
    ddp_rank(a.rank, a.port, a.out)
