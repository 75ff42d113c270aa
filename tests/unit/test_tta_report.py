"""The pure part of the time-to-accuracy bench (bench/tta_report.py): targets, time and bytes to a
target, the tables."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import tta_report  # noqa: E402


def run(system: str, evals: list[tuple[float, float]], straggler: str = "none", **kw: object) -> dict:
    logs = kw.pop(
        "logs", [[{"t": 0.0, "step": 0, "tx": 100, "rx": 50}, {"t": 10.0, "step": 20, "tx": 1100, "rx": 2050}]]
    )
    return {
        "rate": "1gbit",
        "workers": 2,
        "straggler": straggler,
        "system": system,
        "evals": [{"t": t, "step": i, "loss": v} for i, (t, v) in enumerate(evals)],
        "logs": logs,
        **kw,
    }


def test_interp_is_linear_inside_and_constant_outside() -> None:
    pts = [(0.0, 0.0), (2.0, 10.0), (4.0, 10.0)]
    assert tta_report.interp(pts, 1.0) == 5.0
    assert tta_report.interp(pts, -1.0) == 0.0
    assert tta_report.interp(pts, 9.0) == 10.0
    with pytest.raises(ValueError):
        tta_report.interp([], 1.0)


def test_time_to_target_interpolates_the_first_crossing() -> None:
    pts = [(0.0, 5.0), (2.0, 3.0), (4.0, 2.0), (6.0, 3.5), (8.0, 1.0)]
    assert tta_report.time_to_target(pts, 2.5) == pytest.approx(3.0)  # between 3.0 at 2 s and 2.0 at 4 s
    assert tta_report.time_to_target(pts, 5.0) == 0.0
    assert tta_report.time_to_target(pts, 0.5) is None


def test_final_is_the_mean_of_the_last_scores() -> None:
    assert tta_report.final(run("sync", [(0, 5.0), (1, 4.0), (2, 3.0), (3, 2.0)])) == pytest.approx(3.0)
    assert tta_report.final(run("sync", [])) is None


def test_target_is_sync_without_straggler_plus_tolerance() -> None:
    runs = [
        run("ddp", [(0, 5.0), (1, 2.0)]),
        run("sync", [(0, 5.0), (1, 2.4)], straggler="slow"),
        run("sync", [(0, 5.0), (1, 3.0), (2, 2.0), (3, 1.0)]),
    ]
    assert tta_report.targets(runs, 0.1) == {("1gbit", 2): pytest.approx(2.1)}
    assert tta_report.targets(runs[:2], 0.1) == {("1gbit", 2): pytest.approx((5.0 + 2.4) / 2 + 0.1)}
    assert tta_report.targets(runs[:1], 0.0) == {("1gbit", 2): pytest.approx(3.5)}  # no sync: the worst final
    assert tta_report.targets(runs, 0.1, fixed=3.3) == {("1gbit", 2): 3.3}


def test_wire_bytes_count_what_the_hosts_sent() -> None:
    ps, ddp = run("sync", [(0, 1.0)]), run("ddp", [(0, 1.0)])
    assert tta_report.wire_bytes(ps, 5.0) == 500 + 1000  # the worker's sending and the shards'
    assert tta_report.wire_bytes(ddp, 5.0) == 500  # ranks receive what other ranks send
    assert tta_report.wire_bytes(ps, float("inf")) == 1000 + 2000


def test_tables_show_times_ratios_and_failures() -> None:
    runs = [
        run("ddp", [(0, 5.0), (4, 3.0), (8, 2.0)], cpu_s=4.0, machine_busy=0.5, host_tx_bytes={"w0": 2e6, "s0": 1e6}),
        run("sync", [(0, 5.0), (2, 3.0), (4, 2.0)]),
        run("async", [(0, 5.0), (8, 4.0)]),
        run("easgd", [], error="easgd failed"),
    ]
    rows = tta_report.score(runs, 0.0)
    target = (5.0 + 3.0 + 2.0) / 3
    assert rows[1]["target"] == pytest.approx(target) and rows[1]["tta_s"] == pytest.approx(2 * (5 - target) / 2)
    assert rows[2]["tta_s"] is None and rows[0]["steps"] == 20
    text = tta_report.table(rows)
    assert "| 20 | 3 | 0.20 | 50% |" in text  # 3 MB sent by all hosts; 4 CPU s over 20 steps
    assert "| 1gbit | 2 | none | easgd | float32 | failed |" in text
    assert "| 1gbit | 2 | none | async | float32 | 3.333 | - | - | 4.500 | 20 | - | - | - |" in text
    summary = tta_report.summary(rows)
    assert "ddp 3.3 | sync 1.7 | 2.00x | 2.00x | - |" in summary
