"""Count the Python function calls of a sync step, worker and shard: a figure load does not bend.

    python bench/step_calls.py --mb 0.04 --steps 2000 [--modules]

Runs ``--shards`` real shard servers (``ps_server.server.start_server``: gRPC, data connections,
the shard's own threads) in this process, and one worker (``PSClient``) in its main thread; a
profile hook (``threading.setprofile``) counts, per thread, every Python function call ("call"
events) and every call of a built-in ("c_call" events) while ``--steps`` steps of a flat float32
model of ``--mb`` MB run after a warm-up (``--modules``: also which of the library's modules ran
Python on each side). A shard's threads are those started while the shards
start (gRPC's own) or named ``shard*`` (``ps_server.threads.OwnedThreads``: pools started lazily,
data connections); the others are the worker's. Prints the counts per step.

Wall and CPU time per step vary by ±20 % between runs of the same code on a shared 2-core machine
(CPU frequency, other tenants); these counts are the same from run to run (±1 from the lease
reaper and heartbeats, which run on time, not per step), so a change to the step's path shows
in them when a timing cannot resolve it. They are no substitute for the timings of
``bench/run.py``: a torch kernel counts one call whatever its cost. The hook slows every call:
this script prints no timings.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ps_server.config import ServerConfig  # noqa: E402
from ps_server.server import start_server  # noqa: E402
from ps_worker import PSClient  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[1]) + "/"
PACKAGES = tuple(ROOT + p + "/" for p in ("ps_common", "ps_server", "ps_worker"))
"""Where the library's modules live (``--modules`` counts those a step runs)."""

SHARD_THREADS = ("shard", "lease-reaper")
"""Prefixes of the names of a shard server's own threads (``ps_server.threads.OwnedThreads``)."""


class CallCounter:
    """Per side ("worker", "shards"), the "call" and "c_call" events of :func:`sys.setprofile` while
    :attr:`on`; a thread's side is fixed at its first event (:attr:`starting`: the shards are starting)."""

    def __init__(self) -> None:
        self.on = False
        self.starting = False
        self.sides: dict[threading.Thread, str] = {}
        """By thread object: a thread's ident is reused once it ends."""
        self.calls: Counter[str] = Counter()
        self.c_calls: Counter[str] = Counter()
        self.modules: dict[str, set[str]] = {"worker": set(), "shards": set()}
        """Per side, the files of this repository's packages whose Python ran (``--modules``)."""

    def __call__(self, frame: object, event: str, arg: object) -> None:
        thread = threading.current_thread()
        side = self.sides.get(thread)
        if side is None:
            shard = self.starting or thread.name.startswith(SHARD_THREADS)
            side = self.sides[thread] = "shards" if shard else "worker"
        if not self.on:
            return
        if event == "call":
            self.calls[side] += 1
            name = frame.f_code.co_filename  # type: ignore[attr-defined]
            if name.startswith(PACKAGES):
                self.modules[side].add(name[len(ROOT) :])
        elif event == "c_call":
            self.c_calls[side] += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=0.04, help="model size in MB (10^6 bytes) of float32")
    p.add_argument("--steps", type=int, default=2000, help="steps counted (after --warmup)")
    p.add_argument("--warmup", type=int, default=200, help="steps run before counting")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--data-path", choices=("tcp", "grpc"), default="tcp", help="PSClient data_path")
    p.add_argument("--modules", action="store_true", help="also list the library's modules each side's step runs")
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.shards < 1 or args.mb <= 0:
        p.error("--steps and --shards must be >= 1, --warmup >= 0, --mb > 0")

    counter = CallCounter()
    threading.setprofile(counter)  # every thread started from here on: the shards' and the client's
    counter.sides[threading.current_thread()] = "worker"
    servers = []
    try:
        counter.starting = True
        for k in range(args.shards):
            config = ServerConfig(
                shard_index=k,
                num_shards=args.shards,
                num_workers=1,
                host="127.0.0.1",
                port=0,
                data_port=0,  # ps-server's default: a free port
                metrics_port=-1,
            )
            servers.append(start_server(config))
        counter.starting = False
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.zeros(int(args.mb * 1e6) // 4))
        addresses = [s.address for s in servers]
        with PSClient(addresses, 0, 1, timeout=300, data_path=args.data_path) as client:
            client.init(model, {"name": "sgd", "lr": 1e-3})
            grads = {"w": torch.randn_like(model.w) * 1e-3}
            params = {"w": model.w.data}
            for _ in range(args.warmup):
                client.push_pull(grads, params)
            sys.setprofile(counter)
            counter.on = True
            for _ in range(args.steps):
                client.push_pull(grads, params)
            counter.on = False
            sys.setprofile(None)
    finally:
        threading.setprofile(None)
        for s in servers:
            s.stop(grace=0.0)
    worker, shards = (counter.calls[side] / args.steps for side in ("worker", "shards"))
    worker_c, shards_c = (counter.c_calls[side] / args.steps for side in ("worker", "shards"))
    print(f"{args.mb:g} MB, {args.shards} shard(s), data path {args.data_path}, {args.steps} steps")
    print(f"Python function calls per step: worker {worker:.1f}, shards {shards:.1f}")
    print(f"built-in calls per step:        worker {worker_c:.1f}, shards {shards_c:.1f}")
    if args.modules:
        for side, names in counter.modules.items():
            print(f"modules run per step by the {side}: {len(names)}: {' '.join(sorted(names))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
