"""A character-level GPT (grpc-ps's ``charlm`` model) with bf16 autocast, gradient clipping and
gradient accumulation, trained through grpc-ps.

    ps-launch --shards 2 --workers 2 --optimizer adamw --lr 0.003 --steps 200 examples/charlm_gpt.py
    ps-launch --workers 2 --steps 20 examples/charlm_gpt.py --accum 2 --layers 1 --block-size 32

- bf16 autocast: the forward runs under ``torch.autocast(device, dtype=torch.bfloat16)``; the weights,
  their gradients and the shards' optimizer state stay float32 (no GradScaler: bf16 has float32's range).
- gradient accumulation: ``--accum K`` micro-batches per step; each backward adds into ``.grad`` and
  ``DistributedOptimizer(backward_passes_per_step=K)`` pushes their sum once per step (the loss is
  divided by K, so it is the mean, as with DDP).
- gradient clipping: in sync mode ``opt.clip_grad_norm_`` clips the round's averaged gradient by its
  norm over every shard, as DDP clips after its all-reduce; the other modes have no round average,
  so there torch's ``clip_grad_norm_`` clips this rank's accumulated gradient before the push.

The data: the Python standard library's source as bytes (no download), or ``--corpus FILE``; the
held-out blocks report bits per character. Steps, batch, optimizer, lr and seed come from ``PS_STEPS``,
``PS_BATCH_SIZE``, ``PS_OPTIMIZER``, ``PS_LR`` and ``PS_SEED`` (ps-launch's ``--steps``, ...).
"""

import argparse
import json

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ps_worker import DistributedOptimizer, PSClient
from ps_worker.env import read_env
from ps_worker.resume import ResumableSampler, reseed, resume_step
from ps_worker.workloads.charlm import CharLMWorkload, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per step (gradient accumulation)")
    parser.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    parser.add_argument("--block-size", type=int, default=64, help="characters of context")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--corpus", default="", help="text file (default: the standard library's source)")
    parser.add_argument("--corpus-bytes", type=int, default=1_000_000, help="bytes of the corpus used")
    args = parser.parse_args()
    env = read_env()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    config = GPTConfig(block_size=args.block_size, n_layer=args.layers, n_head=4, n_embd=args.embd)
    workload = CharLMWorkload(args.corpus or None, config=config, max_corpus_bytes=args.corpus_bytes, eval_blocks=64)
    train_set, held_out = workload.datasets()
    torch.manual_seed(env.seed)
    model = workload.model().to(device)
    client = PSClient.from_env(model)  # rank 0 writes the weights and PS_OPTIMIZER (e.g. adamw) to the shards
    start = resume_step(client)
    reseed(env.seed, env.rank, start)
    opt = DistributedOptimizer(model, client, backward_passes_per_step=args.accum)
    micro = max(1, env.batch_size // args.accum)  # samples per micro-batch; a step sees accum of them
    sampler = ResumableSampler(
        DistributedSampler(train_set, client.num_workers, client.rank, shuffle=True, seed=env.seed, drop_last=True),
        micro * args.accum,
        start_step=start,
    )
    loader = DataLoader(train_set, batch_size=micro, sampler=sampler, drop_last=True)

    model.train()
    step, losses = start, []
    for _epoch in sampler.epochs():
        batches = iter(loader)
        while step < env.steps:
            pieces = [next(batches, None) for _ in range(args.accum)]
            if pieces[-1] is None:
                break  # the epoch's last partial step: the next epoch starts a whole one
            opt.zero_grad()
            total = 0.0
            for x, y in pieces:
                with torch.autocast(device_type=device, dtype=torch.bfloat16):
                    loss = workload.loss(model, x.to(device), y.to(device)) / args.accum
                loss.backward()
                total += loss.item()
            if args.clip > 0 and client.mode == "sync":
                opt.clip_grad_norm_(args.clip)  # the averaged gradient's norm, as DDP's
            elif args.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # this rank's gradient
            opt.step()
            losses.append(total)
            step += 1
        if step >= env.steps:
            break
    client.close()

    model.eval()
    scores = workload.evaluate(model.float().cpu(), held_out)
    last = sum(losses[-10:]) / max(1, len(losses[-10:]))
    print(f"rank {env.rank}: steps {start}..{step}, loss {last:.3f}, held-out {scores['bits_per_char']:.3f} bits/char")
    print(json.dumps({"event": "done", "rank": env.rank, "final_loss": last, **scores}))


if __name__ == "__main__":
    main()
