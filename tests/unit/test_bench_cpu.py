"""The emulated bench's reading of the machine's CPU time (/proc/stat), which tells a step bound by
this machine's CPUs from one bound by its links."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _common  # noqa: E402


def test_machine_ticks_count_up_and_busy_is_part_of_total() -> None:
    busy0, total0 = _common.machine_ticks()
    assert 0 <= busy0 <= total0
    sum(i * i for i in range(200_000))  # some CPU time
    busy1, total1 = _common.machine_ticks()
    assert busy1 >= busy0 and total1 >= total0


def test_busy_fraction_is_the_busy_share_of_the_interval() -> None:
    assert _common.busy_fraction((100, 1000), (175, 1100)) == 0.75
    assert _common.busy_fraction((5, 10), (5, 10)) == 0.0  # no time passed: nothing to divide
