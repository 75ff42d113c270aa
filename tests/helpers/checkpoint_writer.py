"""A fork server of checkpoint writers, for the crash tests: torch is imported once, writers are forked.

Run as ``python -m tests.helpers.checkpoint_writer DIR [--shard-index K] [--keep N] [--mib M]`` from
the repository root. It prints ``ready`` and then reads commands on stdin, one per line:

- ``spawn``: fork a writer and print ``spawned PID``. The writer opens a :class:`CheckpointStore` on
  DIR, resumes from ``load_latest()`` (prints ``resumed PID V``, V = 0 when there is none) and saves
  :func:`expected_state` of V+1, V+2, … forever, printing ``writing PID V`` just before each save
  and ``saved PID V SECONDS`` after it; on an error it prints ``error PID MESSAGE`` and exits 1.
- ``reap PID``: wait for that writer to end and print ``reaped PID SIGNAL EXITCODE`` (after this
  line, every line the writer printed has been printed).

On end of input it kills (SIGKILL) and reaps the writers still running, then exits. A writer also
dies with the fork server (PR_SET_PDEATHSIG). Every line is written with one ``os.write``, so lines
of different processes never interleave.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ps_server.checkpoint.files import CheckpointStore

PARTITIONS = 4
"""The state's 1-D float32 tensors; together ``mib`` MiB."""


def expected_state(version: int, mib: int) -> dict[str, Any]:
    """The state saved at ``version``: a deterministic function of it (constant and seeded random tensors)."""
    n = mib * 2**20 // 4 // PARTITIONS
    g = torch.Generator().manual_seed(version)
    tensors = [
        torch.full((n,), float(version)) if i % 2 == 0 else torch.randn(n, generator=g) for i in range(PARTITIONS)
    ]
    return {
        "plan": {"specs": [["w", [PARTITIONS * n], "float32"]], "num_shards": 1, "partition_bytes": 4 * n},
        "tensors": tensors,
        "optimizer": {"name": "sgd", "kwargs": {"lr": 0.1, "momentum": 0.9}},
        "optimizer_state": {
            "state": {i: {"momentum_buffer": torch.full((1000,), -float(version))} for i in range(PARTITIONS)},
            "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": list(range(PARTITIONS))}],
        },
        "members": [{"rank": 0, "incarnation": 1, "clock": version, "state": "live"}],
    }


def say(*words: object) -> None:
    os.write(1, (" ".join(str(w) for w in words) + "\n").encode())


def die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def writer(directory: Path, shard_index: int, keep: int, mib: int) -> None:
    """Body of a forked writer; never returns."""
    pid = os.getpid()
    try:
        die_with_parent()
        torch.set_num_threads(1)
        store = CheckpointStore(directory, shard_index, keep=keep)
        latest = store.load_latest()
        version = latest[0] if latest else 0
        say("resumed", pid, version)
        while True:
            version += 1
            state = expected_state(version, mib)
            say("writing", pid, version)
            start = time.perf_counter()
            store.save(state, version)
            say("saved", pid, version, f"{time.perf_counter() - start:.6f}")
    except BaseException as exc:
        say("error", pid, f"{type(exc).__name__}: {exc}".replace("\n", " "))
        os._exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--shard-index", type=int, default=0)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--mib", type=int, default=4)
    args = parser.parse_args()
    children: set[int] = set()
    say("ready")
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "spawn":
            pid = os.fork()
            if pid == 0:
                writer(args.directory, args.shard_index, args.keep, args.mib)
            children.add(pid)
            say("spawned", pid)
        elif command == "reap":
            pid = int(rest[0])
            _, status = os.waitpid(pid, 0)
            children.discard(pid)
            say("reaped", pid, os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0, os.waitstatus_to_exitcode(status))
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
