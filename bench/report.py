"""The report of ``run.py``: the samples per series, the ratios the performance issue targets, the table
and the JSON."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from _common import GLIBC_TUNABLES, describe
from systems import BEFORE, Size


@dataclass
class Series:
    """Samples of one (size, system, series, rank), per round."""

    size: Size
    system: str
    family: str
    series: str
    rank: int
    rounds: list[list[float]] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    """CPU seconds per step of all the system's processes, one value per round."""
    cpu_sides: dict[str, list[float]] = field(default_factory=dict)
    """The same, of each side apart (grpc-ps: ``workers``, ``shards``)."""

    @property
    def samples(self) -> list[float]:
        return [s for r in self.rounds for s in r]


def find(results: Sequence[Series], size: str, system: str, series: str | None = None) -> Series | None:
    for r in results:
        if r.size.label == size and r.system == system and r.rank == 0 and (series is None or r.series == series):
            return r
    return None


@dataclass(frozen=True)
class Ratio:
    name: str
    numerator: Series
    denominator: Series
    target: str
    met: bool | None
    value: float
    paired: tuple[float, float]


def ratio(name: str, a: Series | None, b: Series | None, target: str, ok: Any) -> Ratio | None:
    """median(a) / median(b); ``paired``: min-max of the per-round ratios of medians."""
    if a is None or b is None:
        return None
    value = statistics.median(a.samples) / statistics.median(b.samples)
    per_round = [statistics.median(x) / statistics.median(y) for x, y in zip(a.rounds, b.rounds, strict=False)]
    return Ratio(name, a, b, target, bool(ok(value)), value, (min(per_round), max(per_round)))


def ratios(results: Sequence[Series]) -> list[Ratio]:
    """The performance issue's targets: (1) ahead of the rpc PS at every size and worker count, the
    small-model step, a plain start; (2) near the transport's floor; (4) the moonshot. Target (3),
    emulated links, is ``bench/emulated.py``'s."""
    sizes = sorted({r.size for r in results if r.size.model == "flat"}, key=lambda s: s.nbytes)
    out: list[Ratio | None] = []
    for size in sizes:
        for w, s in ((1, 1), (1, 2), (2, 1), (2, 2)):
            out.append(
                ratio(
                    f"(1) rpc PS {w}w / grpc-ps {w}w×{s}s (speed-up), {size.label}",
                    find(results, size.label, f"rpc PS {w}w"),
                    find(results, size.label, f"grpc-ps {w}w×{s}s"),
                    "≥ 1.0",
                    lambda v: v >= 1.0,
                )
            )
    small = find(results, "small", "grpc-ps 1w×1s")
    if small is not None:
        ms = statistics.median(small.samples) * 1000
        per_round = [statistics.median(r) * 1000 for r in small.rounds]
        out.append(
            Ratio(
                "(1) small-model sync step, grpc-ps 1w×1s, median ms",
                small,
                small,
                "≤ 1.0 ms",
                ms <= 1.0,
                ms,
                (min(per_round), max(per_round)),
            )
        )
        out.append(
            ratio(
                "(1) rpc PS 1w / grpc-ps 1w×1s (speed-up), small",
                find(results, "small", "rpc PS 1w"),
                small,
                "≥ 1.0",
                lambda v: v >= 1.0,
            )
        )
        out.append(
            ratio(
                "(1) grpc-ps 1w×1s gRPC only / calls on the data connection (speed-up), small",
                find(results, "small", "grpc-ps 1w×1s gRPC only"),
                small,
                "(info)",
                lambda v: True,
            )
        )
    if sizes:
        big = sizes[-1].label
        grpc11 = find(results, big, "grpc-ps 1w×1s")
        out.append(
            ratio(
                f"(1) grpc-ps 1w×1s started plainly / under ps-launch's environment, {big}",
                find(results, big, "grpc-ps 1w×1s plain"),
                grpc11,
                "≤ 1.1",
                lambda v: v <= 1.1,
            )
        )
        out.append(
            ratio(
                f"(2) grpc-ps 1w×1s / grpc echo (the transport's floor), {big}",
                grpc11,
                find(results, big, "grpc echo"),
                "≤ 1.15",
                lambda v: v <= 1.15,
            )
        )
        out.append(
            ratio(
                f"(2) grpc-ps 1w×1s / loopback TCP (the data connections' floor), {big}",
                grpc11,
                find(results, big, "loopback TCP"),
                "≤ 1.15",
                lambda v: v <= 1.15,
            )
        )
        out.append(
            ratio(
                f"(2) grpc-ps 1w×1s gRPC only / grpc echo, {big}",
                find(results, big, "grpc-ps 1w×1s gRPC only"),
                find(results, big, "grpc echo"),
                "(info)",
                lambda v: True,
            )
        )
        out.append(
            ratio(
                f"(2) grpc-ps 1w×1s gRPC only / with data connections (speed-up), {big}",
                find(results, big, "grpc-ps 1w×1s gRPC only"),
                grpc11,
                "(info)",
                lambda v: True,
            )
        )
        out.append(
            ratio(
                f"(2) grpc echo / loopback TCP round trip, {big}",
                find(results, big, "grpc echo"),
                find(results, big, "loopback TCP"),
                "(info)",
                lambda v: True,
            )
        )
        out.append(
            ratio(
                f"(4) grpc-ps 1w×1s / loopback TCP round trip, {big}",
                grpc11,
                find(results, big, "loopback TCP"),
                "≤ 1.5",
                lambda v: v <= 1.5,
            )
        )
        out.append(
            ratio(
                f"(4) rpc PS 1w / grpc-ps 1w×1s (speed-up), {big}",
                find(results, big, "rpc PS 1w"),
                grpc11,
                "≥ 1.5",
                lambda v: v >= 1.5,
            )
        )
        native = find(results, big, "native PS prototype 1w")
        out.append(
            ratio(
                f"(4) native PS prototype 1w / loopback TCP round trip, {big}",
                native,
                find(results, big, "loopback TCP"),
                "≤ 1.5",
                lambda v: v <= 1.5,
            )
        )
        out.append(
            ratio(
                f"(4) rpc PS 1w / native PS prototype 1w (speed-up), {big}",
                find(results, big, "rpc PS 1w"),
                native,
                "≥ 1.5",
                lambda v: v >= 1.5,
            )
        )
    for r in results:  # another checkout's twin, against this one's: the speed-up of the change
        twin = find(results, r.size.label, r.system + BEFORE, r.series) if r.rank == 0 else None
        if twin is not None:
            out.append(ratio(f"{r.system}: before / now (speed-up), {r.size.label}", twin, r, "(info)", lambda v: True))
    return [r for r in out if r is not None]


def table(
    results: Sequence[Series], found: Sequence[Ratio], args: argparse.Namespace, timings: dict[str, float]
) -> str:
    """The printed report: one row per (size, system, series), then the targets."""
    lines = []
    head = f"{'size':<6} {'system':<32} {'series':<13} {'median ms':>10} {'min–max ms':>19} {'GB/s':>6} {'CPU ms':>7}"
    head += f" {'n':>4}"
    lines += [head, "-" * len(head)]
    for r in results:
        if r.rank != 0:
            continue
        d = describe(r.samples)
        gbs = r.size.nbytes / d["median"] / 1e9
        span = f"{d['min'] * 1000:.3f}–{d['max'] * 1000:.2f}"
        median, n, cpu = d["median"] * 1000, d["n"], statistics.median(r.cpu) * 1000
        row = f"{r.size.label:<6} {r.system:<32} {r.series:<13} {median:>10.3f} {span:>19} {gbs:>6.2f} {cpu:>7.1f}"
        lines.append(f"{row} {n:>4}")
    lines.append("")
    lines.append("GB/s = payload bytes / median step (a step moves the payload up and down: push+pull, round trip).")
    lines.append("CPU ms = CPU time (user + system, all threads) of all the system's processes per step, median of")
    lines.append("the rounds; it does not depend on how much of the machine other processes take.")
    lines.append("")
    split = [r for r in results if r.rank == 0 and r.cpu_sides]
    if split:
        lines.append(f"{'size':<6} {'system':<32} {'CPU ms: workers':>16} {'shards':>8}  (per step, all of each side)")
        for r in split:
            w, s = (statistics.median(r.cpu_sides[k]) * 1000 for k in ("workers", "shards"))
            lines.append(f"{r.size.label:<6} {r.system:<32} {w:>16.2f} {s:>8.2f}")
        lines.append("")
    lines.append(f"{'target':<62} {'value':>7} {'per-round':>13} {'goal':>9}  met")
    for q in found:
        lo, hi = q.paired
        mark = "—" if q.target == "(info)" else "yes" if q.met else "NO"
        lines.append(f"{q.name:<62} {q.value:>7.2f} {f'{lo:.2f}–{hi:.2f}':>13} {q.target:>9}  {mark}")
    lines.append("")
    lines.append(f"Every measured process ran with GLIBC_TUNABLES={GLIBC_TUNABLES}")
    lines.append("(except the 'plain' rows: started without it, as a user starts ps-server and ps-worker)")
    lines.append(f"and OMP_NUM_THREADS={args.threads}; {os.cpu_count()} cores; {args.rounds} rounds alternating.")
    lines.append("Load average (1, 5, 15 min) at the end: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    lines.append("Timings: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
    return "\n".join(lines)


def to_json(results: Sequence[Series], found: Sequence[Ratio], args: argparse.Namespace, timings: dict[str, float]):
    import grpc
    import torch

    return {
        "meta": {
            "command": sys.argv,
            "quick": args.quick,
            "rounds": args.rounds,
            "threads": args.threads,
            "glibc_tunables": GLIBC_TUNABLES,
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "grpcio": grpc.__version__,
            "load_average": list(os.getloadavg()),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "timings_seconds": timings,
        },
        "results": [
            {
                "size": r.size.label,
                "bytes": r.size.nbytes,
                "system": r.system,
                "family": r.family,
                "series": r.series,
                "rank": r.rank,
                **describe(r.samples),
                "rounds": r.rounds,
                "cpu_seconds_per_step": r.cpu,
                "cpu_seconds_per_step_by_side": r.cpu_sides,
            }
            for r in results
        ],
        "ratios": [
            {
                "name": q.name,
                "value": q.value,
                "per_round_min": q.paired[0],
                "per_round_max": q.paired[1],
                "target": q.target,
                "met": q.met,
            }
            for q in found
        ],
    }
