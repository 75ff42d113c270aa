"""Checkpoint save and load times of one shard for a few state sizes on this machine (a benchmark, not a test).

Usage: ``python bench/checkpoint_io.py [--sizes-mib 4 64 256] [--repeats 3] [--dir DIR]``

The state is what a shard saves: its partitions as 1-D float32 tensors of at most 4 MiB each
(``partition_bytes``), ``--sizes-mib`` MiB in all. Columns (medians over ``--repeats``):

- ``save``: :meth:`CheckpointStore.save` end to end: digest, torch.save to a temp file, fsync,
  rename, directory fsync, pruning. ``digest`` is the sha256 part of it, measured alone.
- ``load cold``: :meth:`CheckpointStore.load_latest` (torch.load with weights_only=True plus the
  digest check) after the file was evicted from the page cache (posix_fadvise DONTNEED, this file
  only); ``load warm``: the same with the file cached.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from ps_server.checkpoint.files import CheckpointStore, digest

PARTITION_BYTES = 4 * 2**20
T = TypeVar("T")


def make_state(mib: int) -> dict:
    numel = mib * 2**20 // 4
    sizes = [PARTITION_BYTES // 4] * (numel // (PARTITION_BYTES // 4))
    if numel % (PARTITION_BYTES // 4):
        sizes.append(numel % (PARTITION_BYTES // 4))
    g = torch.Generator().manual_seed(0)
    return {"tensors": [torch.randn(n, generator=g) for n in sizes], "settings": {"mode": "sync"}}


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """(seconds, result) of ``fn()``."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def bench(directory: Path, mib: int, repeats: int) -> dict[str, float]:
    state = make_state(mib)
    store = CheckpointStore(directory, shard_index=0, keep=1)
    rows: dict[str, list[float]] = {"save": [], "digest": [], "load cold": [], "load warm": []}
    size = 0
    for version in range(1, repeats + 1):
        rows["digest"].append(timed(lambda: digest(state))[0])
        seconds, path = timed(functools.partial(store.save, state, version))
        rows["save"].append(seconds)
        size = path.stat().st_size
        evict(path)
        seconds, loaded = timed(store.load_latest)
        rows["load cold"].append(seconds)
        assert loaded is not None and loaded[0] == version
        del loaded
        rows["load warm"].append(timed(store.load_latest)[0])
    medians = {k: statistics.median(v) for k, v in rows.items()}
    medians["file MiB"] = size / 2**20
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir in $TMPDIR)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="ps-ckpt-bench-", dir=args.dir))
    try:
        print(f"checkpoint I/O, torch {torch.__version__}, {os.cpu_count()} CPUs, directory {root}")
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"medians of {args.repeats}; save includes fsync of the file and the directory; load average {load}\n")
        header = f"{'state MiB':>9} {'file MiB':>9} {'save s':>8} {'MiB/s':>7} {'digest s':>9} "
        header += f"{'load cold s':>11} {'MiB/s':>7} {'load warm s':>11}"
        print(header)
        for mib in args.sizes_mib:
            r = bench(root / f"{mib}", mib, args.repeats)
            print(
                f"{mib:>9} {r['file MiB']:>9.1f} {r['save']:>8.3f} {mib / r['save']:>7.0f} {r['digest']:>9.3f} "
                f"{r['load cold']:>11.3f} {mib / r['load cold']:>7.0f} {r['load warm']:>11.3f}"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
