"""The pure part of ``time_to_accuracy.py``: targets, time and bytes to a target, the tables, the plot.

A run is a dict: ``rate`` (tc text), ``workers``, ``straggler`` (none, slow, pauses), ``system``
(``tta_worker.SYSTEMS``), ``evals`` (rank 0's held-out scores, a list of ``{"t", "step", "loss", ...}``
in time order; ``t`` in seconds since the common start), ``logs`` (per rank, a list of ``{"t",
"step", "tx", "rx"}``: cumulative bytes of that rank's link), ``host_tx_bytes`` (role -> bytes every host's
link sent from the start to rank 0's budget), and ``error`` when it failed. The
metric is the held-out ``loss`` (cross-entropy, nats per char; lower is better).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any

METRIC = "loss"
FINAL_POINTS = 3
"""A run's metric at its budget is the mean of its last 3 scores (the last quarter of the budget at
the default 12 scores a run): one score of a batch-8 run moves by up to 0.1 nats from copy to copy."""
DDP_SYSTEMS = ("ddp", "ddp-bf16")
PS_SYSTEMS = ("sync", "sync-bf16", "async", "ssp", "easgd", "diloco-10", "diloco-50", "avg-50")
WIRE = {"ddp": "float32", "ddp-bf16": "bfloat16", "sync-bf16": "bfloat16"}
"""Wire dtype of each system (float32 when not listed)."""

Run = dict[str, Any]


def interp(points: Sequence[tuple[float, float]], t: float) -> float:
    """The piecewise-linear value at ``t`` of ``points`` ((t, v), t ascending), held constant
    outside their range.

    Raises:
        ValueError: no points.
    """
    if not points:
        raise ValueError("interp needs at least one point")
    ts = [p[0] for p in points]
    i = bisect.bisect_right(ts, t)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (t0, v0), (t1, v1) = points[i - 1], points[i]
    return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def time_to_target(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """Seconds at which the metric (lower is better) first reaches ``target``, interpolated linearly
    between the last score above it and the first at or below it; None if it never does."""
    for i, (t, v) in enumerate(points):
        if v <= target:
            if i == 0:
                return t
            tp, vp = points[i - 1]
            return tp + (t - tp) * (vp - target) / (vp - v)
    return None


def wire_bytes(run: Run, t: float) -> float:
    """Bytes put on the network by the run's hosts in its first ``t`` seconds: every rank's link
    counters (interpolated at ``t``, less their value at the start). DDP ranks only talk to each
    other, so what they sent is everything; grpc-ps workers talk only to shards, so it is what they
    sent and what they received (the shards' sending)."""
    total = 0.0
    with_rx = run["system"] not in DDP_SYSTEMS
    for log in run["logs"]:
        if not log:
            continue
        tx = [(p["t"], p["tx"] - log[0]["tx"]) for p in log]
        total += interp(tx, t)
        if with_rx:
            total += interp([(p["t"], p["rx"] - log[0]["rx"]) for p in log], t)
    return total


def curve(run: Run) -> list[tuple[float, float]]:
    """(seconds, held-out loss) of a run, in time order."""
    return [(e["t"], e[METRIC]) for e in run.get("evals", [])]


def final(run: Run) -> float | None:
    """The metric at the end of the run's budget: the mean of its last :data:`FINAL_POINTS` scores."""
    points = curve(run)[-FINAL_POINTS:]
    return sum(v for _, v in points) / len(points) if points else None


def targets(runs: Iterable[Run], tolerance: float, fixed: float | None = None) -> dict[tuple[str, int], float]:
    """The target of every (rate, workers): the final metric of grpc-ps ``sync`` without a straggler
    at that rate and width, plus ``tolerance`` (``fixed`` instead, when given). Without such a run:
    the sync run with a straggler, else the worst final metric of the cell's no-straggler runs."""
    cells: dict[tuple[str, int], list[Run]] = {}
    for r in runs:
        if final(r) is not None:
            cells.setdefault((r["rate"], r["workers"]), []).append(r)
    out = {}
    for cell, rs in cells.items():
        if fixed is not None:
            out[cell] = fixed
            continue
        order = [r for r in rs if r["system"] == "sync" and r["straggler"] == "none"]
        order += [r for r in rs if r["system"] == "sync"]
        plain = [r for r in rs if r["straggler"] == "none"] or rs
        base = final(order[0]) if order else max(final(r) for r in plain)  # type: ignore[type-var]
        out[cell] = base + tolerance  # type: ignore[operator]
    return out


def score(runs: Sequence[Run], tolerance: float, fixed: float | None = None) -> list[dict[str, Any]]:
    """One row per run: target, seconds and bytes to it, metric at the budget, steps."""
    goal = targets(runs, tolerance, fixed)
    rows = []
    for r in runs:
        row = {k: r[k] for k in ("rate", "workers", "straggler", "system")}
        row.update(wire=WIRE.get(r["system"], "float32"), error=r.get("error", ""))
        target = goal.get((r["rate"], r["workers"]))
        tta = time_to_target(curve(r), target) if target is not None else None
        last = r["logs"][0][-1] if r.get("logs") and r["logs"][0] else {}
        row.update(
            target=target,
            tta_s=tta,
            tta_bytes=wire_bytes(r, tta) if tta is not None else None,
            final=final(r),
            steps=last.get("step"),
            seconds=last.get("t"),
            total_bytes=sum(r["host_tx_bytes"].values()) if r.get("host_tx_bytes") else None,
            cpu_s=r.get("cpu_s"),
            busy=r.get("machine_busy"),
        )
        rows.append(row)
    return rows


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The per-run table (markdown). CPU s per step: every process of the run (workers and shards),
    per rank-0 step; machine busy: the share of all the machine's CPU time that was busy meanwhile."""
    lines = [
        "| rate | workers | straggler | system | wire | target, nats | time to target, s | MB to target "
        "| loss at budget | rank-0 steps | MB in all | CPU s per step | machine busy |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['rate']} | {r['workers']} | {r['straggler']} | {r['system']} | {r['wire']} | failed |")
            continue
        mb = [None if r[k] is None else r[k] / 1e6 for k in ("tta_bytes", "total_bytes")]
        per_step = r["cpu_s"] / r["steps"] if r.get("cpu_s") is not None and r["steps"] else None
        lines.append(
            f"| {r['rate']} | {r['workers']} | {r['straggler']} | {r['system']} | {r['wire']} | "
            f"{_num(r['target'], '.3f')} | {_num(r['tta_s'], '.1f')} | {_num(mb[0], '.0f')} | "
            f"{_num(r['final'], '.3f')} | {r['steps'] if r['steps'] is not None else '-'} | {_num(mb[1], '.0f')} | "
            f"{_num(per_step, '.2f')} | {_num(r['busy'], '.0%')} |"
        )
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    """``a / b``: the speed-up of the system that took ``b`` seconds over the one that took ``a``
    (None: it never reached the target)."""
    if a is None and b is None:
        return "neither"
    if b is None:
        return "first only"
    if a is None:
        return "second only"
    return f"{a / b:.2f}x" if b > 0 else "-"


def summary(rows: Sequence[dict[str, Any]]) -> str:
    """Per cell: the best DDP and the best grpc-ps mode to the target, and like-for-like ratios
    (DDP's time over grpc-ps's: above 1, grpc-ps got there sooner; "first only": only DDP reached
    the target, "second only": only grpc-ps did)."""
    cells: dict[tuple[str, int, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        if not r["error"]:
            cells.setdefault((r["rate"], r["workers"], r["straggler"]), {})[r["system"]] = r
    lines = [
        "| rate | workers | straggler | best DDP, s | best grpc-ps, s | best grpc-ps / best DDP "
        "| ddp / sync (fp32) | ddp-bf16 / sync-bf16 |",
        "|---|---:|---|---|---|---:|---:|---:|",
    ]

    def best(sys_rows: dict[str, dict[str, Any]], names: Sequence[str]) -> tuple[str, float | None]:
        got = [(r["tta_s"], n) for n, r in sys_rows.items() if n in names and r["tta_s"] is not None]
        return (min(got)[1], min(got)[0]) if got else ("-", None)

    for (rate, workers, straggler), s in cells.items():
        d_name, d_t = best(s, DDP_SYSTEMS)
        p_name, p_t = best(s, PS_SYSTEMS)
        pairs = [(s.get(a), s.get(b)) for a, b in (("ddp", "sync"), ("ddp-bf16", "sync-bf16"))]
        like = [_ratio(a["tta_s"], b["tta_s"]) if a and b else "-" for a, b in pairs]
        lines.append(
            f"| {rate} | {workers} | {straggler} | {d_name} {_num(d_t, '.1f')} | {p_name} {_num(p_t, '.1f')} | "
            f"{_ratio(d_t, p_t) if d_name != '-' or p_name != '-' else '-'} | {like[0]} | {like[1]} |"
        )
    return "\n".join(lines)


def plot(runs: Sequence[Run], rows: Sequence[dict[str, Any]], path: str) -> None:
    """Held-out loss against wall-clock seconds, one panel per (rate, workers, straggler), one line
    per system, the target dashed; written as a PNG (matplotlib, imported here: an optional
    dependency, ``pip install grpc-ps[bench]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["rate"], r["workers"], r["straggler"]) for r in runs}, key=str)
    cols = min(3, len(cells))
    nrows = (len(cells) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    goal = {(r["rate"], r["workers"]): r["target"] for r in rows}
    for ax, cell in zip(axes.flat, cells, strict=False):
        for r in runs:
            if (r["rate"], r["workers"], r["straggler"]) == cell and curve(r):
                t, v = zip(*curve(r), strict=True)
                ax.plot(t, v, marker=".", linestyle="--" if r["system"] in DDP_SYSTEMS else "-", label=r["system"])
        if goal.get(cell[:2]) is not None:
            ax.axhline(goal[cell[:2]], color="grey", linewidth=0.8, linestyle=":")
            ax.set_ylim(top=goal[cell[:2]] + 1.0)  # the untrained 5.5 nats would flatten the part that matters
        ax.set_title(f"{cell[0]}, {cell[1]} workers, straggler: {cell[2]}", fontsize=9)
        ax.set_xlabel("wall-clock s")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(cells) :]:
        ax.axis("off")
    axes[0][0].set_ylabel("held-out loss, nats/char")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
