"""The benchmark's memory check: a run that would exhaust the machine's memory stops before the
system that could, with what to leave out, instead of meeting the kernel's OOM killer.

Only the pure parts run here (no child processes: that is ``tests/e2e/test_bench_quick.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _common  # noqa: E402
import run  # noqa: E402
import systems  # noqa: E402


def test_memory_available_reads_meminfo() -> None:
    assert 0 < _common.memory_available() < 1 << 50


def test_check_headroom_refuses_with_what_to_leave_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_common, "memory_available", lambda: 3 << 30)
    _common.check_headroom(1 << 30, "set up x")  # 1 GiB + 1 GiB kept free < 3 GiB
    with pytest.raises(_common.HeadroomError, match=r"set up y: 3072 MiB available, it may need 2560 MiB.*--grid"):
        _common.check_headroom(5 << 29, "set up y")


def test_memory_need_counts_every_process_and_scales_with_the_payload() -> None:
    size = systems.Size("100MB", 100_000_000, warmup=1, iters=3)
    grpc = systems.build("grpc-ps 2w×2s", "grpc-ps", 2, 2, 4 << 20, "float32")
    rpc = systems.build("rpc PS 1w", "rpc", 1, 1, 4 << 20, "float32")
    assert grpc.memory_need(size) == 4 * 4 * 100_000_000  # 2 workers + 2 shards, not yet started
    assert grpc.processes_to_prepare() == 2
    assert rpc.memory_factor > grpc.memory_factor
    assert grpc.memory_need(systems.Size("4MB", 4_000_000, warmup=1, iters=3)) * 25 == grpc.memory_need(size)


def test_the_default_grid_is_the_one_that_fits() -> None:
    args = run.parse_args([])
    assert args.grid == [(1, 1), (2, 2)]
