"""Run grpc-ps sync steps in this process against shard processes, with py-spy watching the steady state.

    python bench/profile_step.py --mb 100 --steps 20 --profile-dir /tmp/prof

Starts ``--shards`` shard processes (the environment of ``run.py``), initializes a flat float32
model of ``--mb`` MB, runs two warm-up steps, then records the worker (this process) and every shard
with ``py-spy record --native -f raw`` (collapsed stacks) while ``--steps`` steps run. Prints the
median step in ms. Summarize a profile with ``python bench/profile_summary.py FILE``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import Child, child_env, cpu_seconds, start_shards, timed

from ps_common.process_env import tune_malloc_at_start
from ps_worker.client import PSClient


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=100.0, help="model size in MB (10^6 bytes) of float32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--partition-bytes", type=int, default=4 << 20)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="parameter dtype of the model")
    p.add_argument(
        "--wire-dtype", default="", choices=("", "bfloat16", "float16"), help="PSClient wire_dtype (default: native)"
    )
    p.add_argument("--separate", action="store_true", help="a step is push() then pull() instead of push_pull()")
    p.add_argument(
        "--no-tunables",
        action="store_true",
        help="run the worker (this process) and the shards without GLIBC_TUNABLES (default: both with them)",
    )
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of every process (as run.py's children)")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--profile-dir", default="", help="write worker.txt and shardK.txt here (default: no profile)")
    args = p.parse_args()
    if not args.no_tunables:
        tune_malloc_at_start()  # this process is the worker: the same malloc as run.py's children
    torch.set_num_threads(args.threads)
    log_dir = Path(tempfile.mkdtemp(prefix="grpc-ps-profile-"))
    env = child_env(args.threads)
    if args.no_tunables:
        env.pop("GLIBC_TUNABLES", None)
    shards: list[Child] = []
    spies: list[subprocess.Popen[bytes]] = []
    try:
        shards, servers = start_shards(args.shards, 1, env, log_dir)
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.zeros(int(args.mb * 1e6) // 4, dtype=getattr(torch, args.dtype)))
        with PSClient(
            servers, 0, 1, timeout=300, partition_bytes=args.partition_bytes, wire_dtype=args.wire_dtype or None
        ) as client:
            client.init(model, {"name": "sgd", "lr": 1e-3})
            grads = {"w": torch.randn_like(model.w) * 1e-3}
            params = {"w": model.w.data}

            def step() -> None:
                if args.separate:
                    client.push(grads)
                    client.pull(params)
                else:
                    client.push_pull(grads, params)

            timed(step, 0, 2)
            if args.profile_dir:
                out = Path(args.profile_dir)
                out.mkdir(parents=True, exist_ok=True)
                spy = shutil.which("py-spy") or "py-spy"
                targets = {"worker": os.getpid(), **{f"shard{k}": c.proc.pid for k, c in enumerate(shards)}}
                for name, pid in targets.items():
                    cmd = [spy, "record", "--native", "-f", "raw", "-r", str(args.rate), "--pid", str(pid)]
                    cmd += ["-o", str(out / f"{name}.txt")]
                    with open(out / f"{name}.log", "w") as log:
                        spies.append(subprocess.Popen(cmd, stdout=log, stderr=log))
                time.sleep(1.0)  # py-spy attaches
            cpu0 = [cpu_seconds(os.getpid()), *(cpu_seconds(c.proc.pid) for c in shards)]
            samples = timed(step, args.steps, 0)
            cpu1 = [cpu_seconds(os.getpid()), *(cpu_seconds(c.proc.pid) for c in shards)]
        per_step = [(b - a) / args.steps * 1000 for a, b in zip(cpu0, cpu1, strict=True)]
        print(f"median step {statistics.median(samples) * 1000:.3f} ms over {len(samples)} steps", flush=True)
        print(f"CPU ms per step: worker {per_step[0]:.3f}, shards {', '.join(f'{x:.3f}' for x in per_step[1:])}")
    finally:
        for s in spies:  # py-spy writes its profile on Ctrl-C
            s.send_signal(signal.SIGINT)
        for s in spies:
            try:
                s.wait(timeout=30)
            except subprocess.TimeoutExpired:
                s.kill()
                s.wait(timeout=10)
        for c in shards:
            c.stop(grace=0.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
