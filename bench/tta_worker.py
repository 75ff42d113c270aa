"""One rank of a time-to-accuracy run: trains the charlm GPT under DDP (gloo) or grpc-ps, by the clock.

    python bench/tta_worker.py --system sync --rank 0 --workers 2 --servers 10.77.0.3:PORT,... --budget-s 60
    python bench/tta_worker.py --system ddp --rank 1 --workers 2 --master-addr 10.77.0.1 --port 29500 ...

Started by ``time_to_accuracy.py`` inside its host's network namespace. Line protocol on stdout (JSON):
``{"ready": true, "compute_s": c}`` once the model, the data and the cluster (process group or
``PSClient``) are set up; then it waits for ``{"cmd": "go", "t0": EPOCH_SECONDS}`` on stdin and trains.
Every ``--log-every-s`` it prints ``{"log": {"t", "step", "tx", "rx"}}``: seconds since ``t0``, its
steps, and the bytes its veth link (``$GLOO_SOCKET_IFNAME``) sent and received, read from
``/sys/class/net/IF/statistics`` (the namespace's own sysfs under ``ip netns exec``).

Rank 0 keeps a copy of its weights every ``--eval-every-s`` (and at ``t0`` and at the end); at
``t0 + budget`` it stops, prints ``{"trained": true}``, scores every copy on the held-out blocks
(after the budget, so scoring costs no training time) and prints ``{"eval": {"t", "step", "loss",
"bits_per_char", "accuracy"}}`` per copy, then ``{"done": true}``. The other ranks never stop on
their own before ``t0 + budget + --grace-s`` (a rank that stopped first would leave rank 0 waiting
in a sync round or an all-reduce): the orchestrator stops them once rank 0 is trained.

Systems: ``ddp`` and ``ddp-bf16`` (``DistributedDataParallel`` over gloo; ``-bf16``: its
``bf16_compress_hook``), ``sync``, ``sync-bf16`` (bf16 on the wire), ``async``, ``ssp``, ``easgd``
(``DistributedOptimizer``; the mode is the shards'). Every system trains the same model from the same
seed on the same ``DistributedSampler`` shards with AdamW at ``--lr`` (async and ssp at ``--lr`` /
workers: each of their pushes is an optimizer step of its own; easgd: a local AdamW at ``--lr``;
``diloco-H``: the inner AdamW at ``--lr``, an outer round every H steps, rank 0's snapshots are
theta_global, the model of the last outer round).

Stragglers (``--delay-s D``: sleep D seconds before each step, the orchestrator's (F - 1) x the compute
time of one forward and backward, :func:`calibrate`, for a step F times as long; ``--pauses``: before a
step, with probability ``--pause-prob``, pause a time drawn uniformly from ``--pause-s LO,HI``, seeded,
at most half the budget in all).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ps_worker.workloads.charlm import CharLMWorkload, GPTConfig

SYSTEMS = ("ddp", "ddp-bf16", "sync", "sync-bf16", "async", "ssp", "easgd", "diloco-10", "diloco-50", "avg-50")
MODEL = GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=128)
"""834,304 parameters (3.34 MB float32): 27 ms of a 1 Gbit/s link, 267 ms at 100 Mbit/s."""


def emit(**msg: object) -> None:
    """One JSON line on stdout."""
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def link_bytes(ifname: str) -> tuple[int, int]:
    """(tx, rx) bytes of interface ``ifname`` so far, from sysfs; (0, 0) when there is none."""
    base = Path("/sys/class/net") / ifname / "statistics"
    try:
        return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())
    except (OSError, ValueError):
        return 0, 0


def workload_of(corpus: str, eval_blocks: int = 64) -> CharLMWorkload:
    """The charlm workload of every run: :data:`MODEL` on ``corpus`` (a file; "" for the standard
    library's source, read anew: 2 s, so the orchestrator writes it to a file once)."""
    return CharLMWorkload(corpus or None, config=MODEL, max_corpus_bytes=1_000_000, eval_blocks=eval_blocks)


def calibrate(workload: CharLMWorkload, batch_size: int, repeats: int = 7) -> float:
    """Median seconds of one forward and backward of a fresh model on a batch of ``batch_size``
    training blocks, in this process with one intra-op thread (gradients discarded)."""
    torch.set_num_threads(1)
    train_set, _ = workload.datasets()
    x, y = (torch.stack(v) for v in zip(*(train_set[i] for i in range(batch_size)), strict=True))
    torch.manual_seed(0)
    model = workload.model()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        workload.loss(model, x, y).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


class Straggle:
    """The delays of a straggler rank, before each step (none for other ranks).

    Args:
        delay_s: seconds slept before every step.
        pause_prob: probability of a pause before a step (0: none).
        pause_s: (lo, hi) seconds a pause lasts, drawn uniformly.
        max_pause_s: total pause time allowed.
        seed: of the pauses' generator.
    """

    def __init__(self, delay_s: float, pause_prob: float, pause_s: tuple[float, float], max_pause_s: float, seed: int):
        self.delay_s, self.pause_prob, self.pause_s, self.left = delay_s, pause_prob, pause_s, max_pause_s
        self.rng = random.Random(seed)
        self.paused = 0.0

    def before_step(self) -> None:
        delay = self.delay_s
        if self.pause_prob > 0 and self.rng.random() < self.pause_prob:
            pause = min(self.left, self.rng.uniform(*self.pause_s))
            self.left -= pause
            self.paused += pause
            delay += pause
        if delay > 0:
            time.sleep(delay)


def bf16_hook(process_group: object, bucket: object) -> torch.futures.Future[torch.Tensor]:
    """torch's ``bf16_compress_hook`` itself (cast the bucket to bf16 and divide by the world size,
    all-reduce, widen in place), under another name: DDP refuses a hook *named* so unless CUDA and
    NCCL are there, but gloo all-reduces bfloat16 on CPU, so the wire carries what it would with NCCL."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(process_group, bucket)  # type: ignore[arg-type]


# DDP checks a hook's annotations as objects; this module's are strings (``from __future__ import annotations``).
bf16_hook.__annotations__ = {
    "process_group": torch.distributed.ProcessGroup,
    "bucket": torch.distributed.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def build(args: argparse.Namespace, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    """The trained module and the optimizer whose ``step()`` ends a step; and the PSClient (or None)."""
    lr = args.lr / args.workers if args.system in ("async", "ssp") else args.lr
    if args.system.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel

        torch.distributed.init_process_group(
            "gloo",
            init_method=f"tcp://{args.master_addr}:{args.port}",
            rank=args.rank,
            world_size=args.workers,
            timeout=datetime.timedelta(seconds=args.grace_s),
        )
        ddp = DistributedDataParallel(model)
        if args.system == "ddp-bf16":
            ddp.register_comm_hook(None, bf16_hook)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=lr), None
    from ps_worker import DistributedOptimizer, PSClient

    client = PSClient(
        args.servers.split(","),
        args.rank,
        args.workers,
        timeout=args.grace_s,
        retry_deadline=60,
        partition_bytes=args.partition_bytes,
        wire_dtype="bfloat16" if args.system == "sync-bf16" else None,
    )
    local = torch.optim.AdamW(model.parameters(), lr=lr)
    client.init(model, local)  # rank 0's weights and AdamW spec go to the shards; every rank pulls them
    overlap = args.overlap and args.system in ("sync", "sync-bf16", "async", "ssp")
    return model, DistributedOptimizer(model, client, local, overlap=overlap), client


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    workload = workload_of(args.corpus, args.eval_blocks)
    train_set, held_out = workload.datasets()
    torch.manual_seed(args.seed)
    model = workload.model()
    sampler = DistributedSampler(train_set, args.workers, args.rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    net, opt, client = build(args, model)
    straggle = Straggle(
        args.delay_s, args.pause_prob if args.pauses else 0.0, args.pause_s, args.budget_s / 2, args.seed
    )
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    emit(ready=True, params=sum(p.numel() for p in model.parameters()))

    line = sys.stdin.readline()
    if not line:
        return
    t0 = float(json.loads(line)["t0"])
    while time.time() < t0:
        time.sleep(min(0.05, max(0.0, t0 - time.time())))
    stop_at = t0 + args.budget_s if args.rank == 0 else t0 + args.budget_s + args.grace_s
    snapshots: list[tuple[float, int, dict[str, torch.Tensor]]] = []

    def snapshot(step: int) -> None:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if args.system.startswith(("diloco", "avg")):  # the cluster's model: theta_global of the last outer round
            state.update({k: v.clone() for k, v in opt.local.anchor.items()})  # type: ignore[union-attr]
        snapshots.append((time.time() - t0, step, state))

    def log(step: int) -> None:
        tx, rx = link_bytes(ifname)
        emit(log={"t": time.time() - t0, "step": step, "tx": tx, "rx": rx})

    step, epoch = 0, 0
    log(0)
    if args.rank == 0:
        snapshot(0)
    next_log, next_eval = args.log_every_s, args.eval_every_s
    net.train()
    while time.time() < stop_at:
        sampler.set_epoch(epoch)
        for x, y in loader:
            straggle.before_step()
            opt.zero_grad()
            workload.loss(net, x, y).backward()
            opt.step()
            step += 1
            now = time.time() - t0
            if now >= next_log:
                log(step)
                next_log = now + args.log_every_s
            if args.rank == 0 and now >= next_eval:
                snapshot(step)
                next_eval = now + args.eval_every_s
            if time.time() >= stop_at:
                break
        epoch += 1
    log(step)
    if args.rank != 0:
        return
    if snapshots[-1][1] != step:
        snapshot(step)
    if client is not None:
        client.close()  # type: ignore[attr-defined]  # while the shards are still up
    emit(trained=True, steps=step, paused_s=straggle.paused)
    model.eval()
    for t, s, state in snapshots:
        model.load_state_dict(state)
        emit(eval={"t": t, "step": s, **workload.evaluate(model, held_out)})
    emit(done=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--servers", default="", help="grpc-ps shards, host:port, comma-separated")
    p.add_argument("--master-addr", default="127.0.0.1", help="DDP: rank 0's address")
    p.add_argument("--port", type=int, default=29500, help="DDP: the TCP store's port on rank 0")
    p.add_argument("--budget-s", type=float, default=60.0, help="seconds of training from t0")
    p.add_argument("--grace-s", type=float, default=120.0, help="other ranks' extra seconds; RPC deadlines")
    p.add_argument("--eval-every-s", type=float, default=5.0, help="rank 0 copies its weights this often")
    p.add_argument("--log-every-s", type=float, default=1.0, help="step and link bytes this often")
    p.add_argument("--batch-size", type=int, default=8, help="blocks per step per worker")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (async, ssp: / workers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", default="", help="text file (default: the standard library's source)")
    p.add_argument("--eval-blocks", type=int, default=64, help="held-out blocks of 64 chars scored")
    p.add_argument("--partition-bytes", type=int, default=1 << 20, help="grpc-ps partition size")
    p.add_argument("--no-overlap", dest="overlap", action="store_false", help="grpc-ps: push after backward")
    p.add_argument("--delay-s", type=float, default=0.0, help="straggler: seconds slept before each step")
    p.add_argument("--pauses", action="store_true", help="straggler: random pauses")
    p.add_argument("--pause-prob", type=float, default=0.03)
    p.add_argument("--pause-s", default="0.5,2.0", help="LO,HI seconds of a pause")
    args = p.parse_args(argv)
    lo, hi = (float(v) for v in args.pause_s.split(","))
    args.pause_s = (lo, hi)
    if args.system.startswith("ddp") is False and not args.servers:
        p.error(f"--system {args.system} needs --servers")
    if not 0 <= args.rank < args.workers or args.delay_s < 0 or not 0 <= lo <= hi:
        p.error("0 <= --rank < --workers, --delay-s >= 0, 0 <= LO <= HI")
    return args


if __name__ == "__main__":
    train(parse_args())
