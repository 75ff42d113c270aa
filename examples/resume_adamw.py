"""Checkpoint and resume as a DDP script does: AdamW with two parameter groups (no weight decay on
biases, nanoGPT's split) driven by a warm-up + cosine LambdaLR; rank 0 saves the model, the
optimizer and the scheduler; a later run loads them and carries on where the first stopped.

``--order ddp`` loads the checkpoint where a DDP script does (imagenet, nanoGPT): into the torch
optimizer and the scheduler before the client exists; ``--order docs`` loads it into the
DistributedOptimizer once built. Both end where the uninterrupted run ends::

    ps-launch --shards 2 --workers 2 examples/resume_adamw.py --steps 8 --save full.pt
    ps-launch --shards 2 --workers 2 examples/resume_adamw.py --steps 4 --save half.pt
    ps-launch --shards 2 --workers 2 examples/resume_adamw.py --steps 8 --resume half.pt --save resumed.pt
"""

import argparse
import json
import math

import torch
import torch.nn.functional as F

from ps_worker import DistributedOptimizer, PSClient

HORIZON, WARMUP, BATCH = 40, 3, 16  # the schedule's length in steps; samples per rank and step

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--steps", type=int, default=8, help="train until this step (at most 40)")
parser.add_argument("--resume", default="", help="checkpoint to resume from")
parser.add_argument("--save", default="", help="where rank 0 saves the checkpoint at the end")
parser.add_argument("--order", choices=["ddp", "docs"], default="ddp", help="where the checkpoint is loaded")
args = parser.parse_args()


def lr_factor(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (HORIZON - WARMUP)))


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's samples of ``step``: the same for every run, whatever it resumed from."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 20, generator=g)
    return x, (x[:, :5].sum(1) > 0).long() + (x[:, 5:10].sum(1) > 1).long()


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.GELU(), torch.nn.Linear(32, 3))
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW(
    [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95)
)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
start, checkpoint = 0, None
if args.resume:
    checkpoint = torch.load(args.resume, weights_only=True)
    model.load_state_dict(checkpoint["model"])  # before the client: rank 0's weights initialize the shards
    start = checkpoint["step"]
    if args.order == "ddp":  # where a DDP script loads it, before DDP(model) (here: the client)
        optimizer.load_state_dict(checkpoint["optimizer"])  # its moments go to the shards
        scheduler.load_state_dict(checkpoint["scheduler"])

client = PSClient.from_env(model, optimizer=optimizer)  # was: DDP(model)
opt = DistributedOptimizer(model, client, optimizer)
if checkpoint is not None and args.order == "docs":
    opt.load_state_dict(checkpoint["optimizer"])  # rank 0 sends the moments to the shards
    scheduler.load_state_dict(checkpoint["scheduler"])

loss = torch.tensor(float("nan"))
for step in range(start, args.steps):
    x, y = batch(step, client.rank, client.num_workers)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    scheduler.step()

if client.rank == 0 and args.save:  # opt.state_dict() reads the moments from the shards
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": scheduler.state_dict()}
    torch.save({**state, "step": args.steps}, args.save)
client.close()
print(f"rank {client.rank}: steps {start}..{args.steps}, last loss {loss.item():.4f}, lr {scheduler.get_last_lr()}")
print(json.dumps({"event": "done", "rank": client.rank, "loss": loss.item()}))
