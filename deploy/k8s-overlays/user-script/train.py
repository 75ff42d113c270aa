"""A small CNN with BatchNorm on scikit-learn's bundled 8x8 digits, trained through grpc-ps.

What a real script does, with nothing but the public API: the cluster from the environment contract
(``PSClient.from_env``), ``DistributedSampler`` sharding the data (through ``ResumableSampler``, so a
job restarted from its shards' checkpoints skips the batches it already consumed), a cosine
learning-rate schedule (``torch.optim.lr_scheduler.LambdaLR`` on the ``DistributedOptimizer``: every
push carries the scheduled lr to the shards), BatchNorm running statistics kept like DDP's
``broadcast_buffers``, and the held-out accuracy at the end.

    ps-launch --shards 2 --workers 2 examples/cnn_digits.py            # PS_STEPS=300 steps per rank
    ps-launch --shards 2 --workers 2 --steps 100 examples/cnn_digits.py --channels 8

Script arguments: ``--channels`` (first conv layer's width, default 16), ``--warmup`` (steps of linear
warm-up, default 20). Everything else comes from ``PS_*`` variables: ``PS_STEPS`` (total steps of the
job), ``PS_BATCH_SIZE``, ``PS_OPTIMIZER``, ``PS_LR``, ``PS_MOMENTUM``, ``PS_SEED``.
"""

import argparse
import json
import math

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ps_worker import DistributedOptimizer, PSClient
from ps_worker.env import read_env
from ps_worker.resume import ResumableSampler, reseed, resume_step


def cnn(channels: int) -> nn.Module:
    """[batch, 1, 8, 8] float32 images -> [batch, 10] logits."""
    c = channels
    return nn.Sequential(
        nn.Conv2d(1, c, 3, padding=1, bias=False),
        nn.BatchNorm2d(c),
        nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, padding=1, bias=False),
        nn.BatchNorm2d(2 * c),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Flatten(),
        nn.Linear(2 * c * 16, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    env = read_env()

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    x_train, x_test, y_train, y_test = train_test_split(x, torch.tensor(y), test_size=0.2, random_state=0, stratify=y)
    train_set = TensorDataset(x_train, y_train)

    torch.manual_seed(env.seed)
    model = cnn(args.channels)
    client = PSClient.from_env(model)  # joins; rank 0 writes the initial weights and PS_OPTIMIZER/PS_LR
    start = resume_step(client)  # the cluster's clock: 0 for a new job
    reseed(env.seed, env.rank, start)
    opt = DistributedOptimizer(model, client)

    def schedule(step: int) -> float:  # linear warm-up, then cosine decay to 0 at PS_STEPS
        if step < args.warmup:
            return (step + 1) / args.warmup
        return 0.5 * (1 + math.cos(math.pi * (step - args.warmup) / max(1, env.steps - args.warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: schedule(start + k))
    sampler = ResumableSampler(
        DistributedSampler(train_set, client.num_workers, client.rank, shuffle=True, seed=env.seed, drop_last=True),
        env.batch_size,
        start_step=start,
    )
    loader = DataLoader(train_set, batch_size=env.batch_size, sampler=sampler, drop_last=True)

    model.train()
    step, losses = start, []
    for _epoch in sampler.epochs():
        for xb, yb in loader:
            if step >= env.steps:
                break
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            scheduler.step()
            losses.append(loss.item())
            step += 1
        if step >= env.steps:
            break
    client.close()

    model.eval()  # the running statistics are rank 0's, as DDP's broadcast_buffers leaves them
    with torch.no_grad():
        accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    last = sum(losses[-10:]) / max(1, len(losses[-10:]))
    print(f"rank {env.rank}: steps {start}..{step}, loss {last:.4f}, held-out accuracy {accuracy:.4f}")
    print(json.dumps({"event": "done", "rank": env.rank, "accuracy": accuracy, "final_loss": last}))


if __name__ == "__main__":
    main()
