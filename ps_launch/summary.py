"""ps-launch's account of a run: what each rank did, the summary table and JSON, a finished job."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from ps_common import jsonout
from ps_proto.v1 import ps_pb2


def finished_version(statuses: Sequence[ps_pb2.ShardStatus], steps: int) -> int | None:
    """The version at which the job whose checkpoints every shard resumed from had already run
    ``steps`` steps on every rank (so workers would train nothing); None for a fresh start or a job
    with steps left. The steps a rank has done are those its worker resumes at (``train``): sync, the
    round (version); async and ssp, the rank's clock; easgd, its exchanges times the period; diloco,
    the outer rounds (version) times H.
    """
    if not statuses or not all(st.HasField("restored_from_version") for st in statuses):
        return None
    version = min(st.version for st in statuses)
    config = statuses[0].config
    period = max(1, config.communication_period)
    if config.mode == ps_pb2.MODE_DILOCO:  # --fragments F: a round every H // F inner steps
        period = max(1, period // max(1, config.fragments))
    if config.mode == ps_pb2.MODE_SYNC:
        return version if version >= steps else None
    if config.mode == ps_pb2.MODE_DILOCO:  # the inner steps after the last whole round reach no shard
        return version if version * period >= steps - steps % period else None
    done = [max(st.workers[r].clock for st in statuses) for r in range(len(statuses[0].workers))]
    if config.mode == ps_pb2.MODE_EASGD:
        done = [clock * period for clock in done]
        steps -= steps % period  # the steps after the last whole period end no exchange
    return version if all(d >= steps for d in done) else None


def close_bars(bars: Sequence[tqdm]) -> None:
    """Close the progress bars (last first, so each clears its own line) and leave the cursor at the
    start of a clean line, so what follows is not printed in the middle of a bar's old line."""
    shown = [b for b in bars if not b.disable]
    for b in reversed(bars):
        b.close()
    if shown:
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()


@dataclass
class RankRun:
    """What one process of a rank did, as ps-launch saw it from its events."""

    first: int
    """Step it started at (a restarted rank resumes at the cluster's clock)."""
    last: int
    """Last step it reported."""
    report: dict[str, Any] | None = None
    """Its final report (None: killed before the end)."""
    started: float = 0.0
    """``time.perf_counter()`` of its first step."""

    @property
    def steps(self) -> int:
        return max(0, (self.report["steps"] if self.report else self.last) - self.first)


def _finite(x: Any) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def mean(values: Sequence[float | None]) -> float | None:
    """Mean of the values that are numbers; None when there are none (a rank that trained no step)."""
    known = [v for v in values if v is not None and math.isfinite(v)]
    return sum(known) / len(known) if known else None


def shards_view(statuses: Sequence[ps_pb2.ShardStatus]) -> dict[str, Any]:
    """The shards' account of the run (clocks, states, checkpoints, staleness, bytes), from their status."""
    rejected: dict[str, int] = {}
    for st in statuses:
        for reason, n in st.rejected_pushes.items():
            rejected[reason] = max(rejected.get(reason, 0), n)
    first_status = statuses[0] if statuses else None
    return {
        "versions": [st.version for st in statuses],
        "clocks": [w.clock for w in first_status.workers] if first_status else [],
        "pushes": [w.pushes for w in first_status.workers] if first_status else [],
        "worker_states": [
            ps_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower() for w in first_status.workers
        ]
        if first_status
        else [],
        "incarnations": [w.incarnation for w in first_status.workers] if first_status else [],
        "restored_from": [
            st.restored_from_version if st.HasField("restored_from_version") else None for st in statuses
        ],
        "last_checkpoint": [
            st.last_checkpoint_version if st.HasField("last_checkpoint_version") else None for st in statuses
        ],
        "max_clock_gap": max((st.max_clock_gap for st in statuses), default=0),
        "rejected_pushes": rejected,
        "staleness_p50": max((st.staleness.p50 for st in statuses), default=0.0),
        "staleness_p90": max((st.staleness.p90 for st in statuses), default=0.0),
        "staleness_p99": max((st.staleness.p99 for st in statuses), default=0.0),
        "staleness_max": max((st.staleness.max for st in statuses), default=0),
        "received_bytes": sum(st.received_bytes for st in statuses),
        "sent_bytes": sum(st.sent_bytes for st in statuses),
    }


def rank_rows(args: Any, runs: Mapping[int, Sequence[RankRun]]) -> list[dict[str, Any]]:
    """What each rank did: steps run by all its processes, restarts, where they resumed, finished or not."""
    ranks = []
    for r in range(max(args.workers, len(runs))):  # a resize may have started more ranks
        mine = list(runs.get(r, ()))
        steps = sum(run.steps for run in mine)
        report = next((run.report for run in reversed(mine) if run.report), None)
        ranks.append(
            {
                "rank": r,
                "steps_run": steps,
                "samples": steps * args.batch_size,
                "restarts": max(0, len(mine) - 1),
                "first_step": mine[0].first if mine else 0,
                "resumed_at": [run.first for run in mine[1:]],
                "finished": report is not None,
                "final_loss": _finite(report.get("final_loss")) if report else None,
            }
        )
    return ranks


def summarize(
    args: Any,
    done: list[dict[str, Any]],
    wall: float,
    addresses: list[str],
    statuses: Sequence[ps_pb2.ShardStatus] = (),
    metrics_urls: Mapping[str, str] | None = None,
    runs: Mapping[int, Sequence[RankRun]] | None = None,
    train_seconds: float | None = None,
) -> dict[str, Any]:
    """The run's summary from what each rank actually did: every worker's final report, the steps
    each of its processes ran (``runs``: rank -> its processes, restarts included) and the shards'
    status. ``metrics_urls`` maps process name (``shard-0``, ``worker-1``) to its ``/metrics`` URL.
    Throughput is steps run (all ranks, all processes) over ``train_seconds`` (first step of any
    rank to the last step of all; start-up excluded), and samples are those steps times the batch."""
    done = sorted(done, key=lambda d: d["rank"])
    runs = runs or {d["rank"]: [RankRun(d.get("first_step", 0), d["steps"], d)] for d in done}
    shard_view = shards_view(statuses)
    ranks = rank_rows(args, runs)
    total_steps = sum(r["steps_run"] for r in ranks)
    partial = bool(statuses) and any(r["restarts"] or not r["finished"] for r in ranks)
    seconds = train_seconds if train_seconds else max((d["wall_seconds"] for d in done), default=0.0)
    rate = total_steps / seconds if seconds > 0 else 0.0
    first_done = done[0] if done else {}
    return {
        "workload": args.workload,
        "mode": args.mode,
        "shards": args.shards,
        "workers": args.workers,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "final_loss": mean([r["final_loss"] for r in ranks]),
        "accuracy": first_done.get("accuracy"),
        "eval_loss": _finite(first_done.get("eval_loss")),
        "bits_per_char": first_done.get("bits_per_char"),
        "auc": first_done.get("auc"),
        "ground_truth_auc": first_done.get("ground_truth_auc"),
        "accuracy_per_rank": [d["accuracy"] for d in done],
        "wall_seconds": wall,
        "train_seconds": seconds,
        "steps_per_second": rate,
        "samples_per_second": rate * args.batch_size,
        "steps_run_per_rank": [r["steps_run"] for r in ranks],
        "ranks": ranks,
        # a killed process never reports its bytes: then the shards' count (every process's) is the truth
        "pushed_bytes": shard_view["received_bytes"] if partial else sum(d["pushed_bytes"] for d in done),
        "pulled_bytes": shard_view["sent_bytes"] if partial else sum(d["pulled_bytes"] for d in done),
        "version": first_done.get("version"),
        "params_sha256": first_done.get("params_sha256"),
        "params_sha256_per_rank": [d["params_sha256"] for d in done],
        # a resize (--resize, ps-admin resize) to fewer workers ends the ranks beyond at its round
        "resized_out_at_per_rank": [d.get("resized_out_at") for d in done],
        "num_workers_at_end": statuses[0].config.num_workers if statuses else args.workers,
        "servers": addresses,
        "refused_pushes": sum(d.get("refused_pushes", 0) for d in done),
        "dropped_pushes": sum(d.get("dropped_pushes", 0) for d in done),
        "shards_view": shard_view,
        "metrics_urls": dict(metrics_urls or {}),
    }


def nothing_to_do(args: Any, log_dir: Path, version: int, out: IO[str]) -> None:
    """Say that the job in ``log_dir`` already ran ``--steps`` (``--json``: as one JSON object too)."""
    print(
        f"ps-launch: nothing to do: the job in {log_dir} finished at version {version} (every rank has run "
        f"--steps {args.steps}); use a new --log-dir or raise --steps",
        file=out,
    )
    if args.json:
        summary = {"nothing_to_do": True, "log_dir": str(log_dir), "version": version, "steps": args.steps}
        print(jsonout.dumps({"workload": args.workload, "mode": args.mode, **summary}), file=out, flush=True)


STALENESS_UNIT = {
    "sync": "sync: every gradient is applied to the version it was computed on",
    "async": "versions behind when applied (--max-staleness bounds it)",
    "ssp": "versions behind when applied; the bound s counts clocks (see the gap above)",
    "easgd": "not measured (workers exchange parameters)",
    "diloco": "not measured (an outer round is a sync round)",
}


def _restart_note(ranks: Sequence[dict[str, Any]]) -> str:
    notes = [
        f"rank {r['rank']} restarted {r['restarts']}x, resumed at step {', '.join(map(str, r['resumed_at']))}"
        for r in ranks
        if r["restarts"]
    ]
    notes += [f"rank {r['rank']} did not finish" for r in ranks if not r["finished"]]
    return f" ({'; '.join(notes)})" if notes else ""


def print_summary(s: dict[str, Any], out: IO[str]) -> None:
    mib = 1024 * 1024
    view = s["shards_view"]
    loss = s["final_loss"]
    rows = [
        ("workload", f"{s['workload']} ({s['mode']}, {s['shards']} shards x {s['workers']} workers)"),
        ("steps per worker", f"{s['steps']} (batch {s['batch_size']})"),
        ("steps run per rank", f"{s['steps_run_per_rank']}{_restart_note(s['ranks'])}"),
        (
            "final loss",
            "-" if loss is None else f"{loss:.4f} (mean of the last 10 steps of each rank that finished)",
        ),
        ("held-out accuracy", "-" if s["accuracy"] is None else f"{s['accuracy']:.4f}"),
        ("held-out loss", "-" if s["eval_loss"] is None else f"{s['eval_loss']:.3g}"),
    ]
    if s.get("bits_per_char") is not None:
        rows.append(("bits per char", f"{s['bits_per_char']:.3f} (held out)"))
    if s.get("auc") is not None:
        rows.append(("held-out AUC", f"{s['auc']:.4f} (ground truth {s['ground_truth_auc']:.4f})"))
    rows += [
        ("wall time", f"{s['wall_seconds']:.1f} s (training {s['train_seconds']:.1f} s)"),
        ("throughput", f"{s['steps_per_second']:.1f} steps/s, {s['samples_per_second']:.0f} samples/s (all ranks)"),
        ("bytes moved", f"pushed {s['pushed_bytes'] / mib:.1f} MiB, pulled {s['pulled_bytes'] / mib:.1f} MiB"),
        ("final version", str(s["version"])),
        ("clocks per rank", f"{view['clocks']} (largest gap at a read: {view['max_clock_gap']})"),
        (
            "staleness",
            f"0 ({STALENESS_UNIT['sync']})"
            if s["mode"] == "sync"
            else "p50 {staleness_p50:g}, p90 {staleness_p90:g}, p99 {staleness_p99:g}, max {staleness_max}".format(
                **view
            )
            + f" ({STALENESS_UNIT.get(s['mode'], 'versions behind')})",
        ),
        ("refused / dropped", f"{s['refused_pushes']} refused as too stale, {s['dropped_pushes']} dropped late"),
        ("params sha256", s["params_sha256"]),
        *([("model saved", s["saved"])] if s.get("saved") else []),
    ]
    width = max(len(k) for k, _ in rows)
    print("grpc-ps run summary", file=out)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}", file=out)
    out.flush()


def local_steps(
    mode: str, statuses: Sequence[ps_pb2.ShardStatus], ranks: list[dict[str, Any]], done: Mapping[int, dict[str, Any]]
) -> int | None:
    """easgd: the shards' clocks count each rank's exchanges, not its steps. Move them to
    ``row["exchanges"]`` and set ``row["steps_run"]`` to its local steps: what its script reported
    (a ``{"event": "done", "local_steps": N}`` line), else the least the exchanges prove (exchanges x
    the period tau; up to tau - 1 more after the last exchange reach no shard: ``row["local_steps_known"]``
    says which). diloco the same with its outer rounds and H. Returns tau (H) in easgd (diloco), None in
    the other modes (their clocks are steps; rows unchanged)."""
    if mode not in ("easgd", "diloco"):
        return None
    period = max(1, statuses[0].config.communication_period) if statuses else 1
    if mode == "diloco" and statuses:  # --fragments F: a round every H // F inner steps
        period = max(1, period // max(1, statuses[0].config.fragments))
    for row in ranks:
        said = done.get(row["rank"], {}).get("local_steps")
        row["exchanges"] = row["steps_run"]
        row["local_steps_known"] = isinstance(said, int)
        row["steps_run"] = said if isinstance(said, int) else row["exchanges"] * period
    return period


def _steps_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The rows of what each rank ran: steps (the shards' clocks), or easgd's exchanges and local steps."""
    ran, restarts = s["steps_run_per_rank"], _restart_note(s["ranks"])
    given = "" if all(n == s["steps"] for n in ran) else f"PS_STEPS was {s['steps']}; the script ran its own count"
    if not s.get("communication_period"):
        return [("steps run per rank", f"{ran}{restarts}" + (f" ({given})" if given else ""))]
    period = s["communication_period"]
    exact = all(r.get("local_steps_known") for r in s["ranks"])
    name = "outer rounds" if s.get("mode") == "diloco" else "exchanges"
    how = "as the script reported" if exact else f"at least {name} x {period}: later ones reach no shard"
    return [
        (f"{name} per rank", f"{s['exchanges_per_rank']}{restarts} (every {period} local steps)"),
        ("local steps per rank", f"{ran} ({how}" + (f"; {given})" if given else ")")),
    ]


def summarize_script(
    args: Any,
    done: Mapping[int, dict[str, Any]],
    wall: float,
    addresses: list[str],
    statuses: Sequence[ps_pb2.ShardStatus],
    runs: Mapping[int, Sequence[RankRun]],
    last_lines: Mapping[int, Sequence[str]],
    train_seconds: float | None = None,
) -> dict[str, Any]:
    """The summary of a run of the user's script: steps each rank ran (from the shards' clocks), the
    shards' view, and what each rank printed last (``last_lines``: rank -> its last stdout lines).
    ``done``: rank -> what its last process reported (``{"event": "done", ...}`` lines it printed,
    merged; at least its steps); a script's own ``accuracy`` there is shown too."""
    ranks = rank_rows(args, runs)
    period = local_steps(args.mode, statuses, ranks, done)
    for row in ranks:
        row["last_line"] = (list(last_lines.get(row["rank"], ())) or [""])[-1]
        row["accuracy"] = done.get(row["rank"], {}).get("accuracy")
    total = sum(r["steps_run"] for r in ranks)
    rate = total / train_seconds if train_seconds else 0.0
    view = shards_view(statuses)
    return {
        "communication_period": period,
        "exchanges_per_rank": [r["exchanges"] for r in ranks] if period else None,
        "workload": args.workload,
        "script": args.workload,
        "mode": args.mode,
        "shards": args.shards,
        "workers": args.workers,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "accuracy": ranks[0]["accuracy"] if ranks else None,
        "wall_seconds": wall,
        "train_seconds": train_seconds or 0.0,
        "steps_per_second": rate,
        "steps_run_per_rank": [r["steps_run"] for r in ranks],
        "ranks": ranks,
        "version": min((st.version for st in statuses), default=None),
        "servers": addresses,
        "pushed_bytes": view["received_bytes"],
        "pulled_bytes": view["sent_bytes"],
        "shards_view": view,
    }


def print_script_summary(s: dict[str, Any], out: IO[str]) -> None:
    """The human summary of a user script's run (``s``: :func:`summarize_script`)."""
    mib = 1024 * 1024
    view = s["shards_view"]
    rows = [
        ("script", f"{s['script']} ({s['mode']}, {s['shards']} shards x {s['workers']} workers)"),
        *_steps_rows(s),
        ("wall time", f"{s['wall_seconds']:.1f} s (training {s['train_seconds']:.1f} s)"),
        ("throughput", f"{s['steps_per_second']:.1f} steps/s (all ranks)"),
        ("bytes moved", f"pushed {s['pushed_bytes'] / mib:.1f} MiB, pulled {s['pulled_bytes'] / mib:.1f} MiB"),
        ("final version", str(s["version"])),
        ("clocks per rank", f"{view['clocks']} (largest gap at a read: {view['max_clock_gap']})"),
    ]
    if s["accuracy"] is not None:
        rows.append(("held-out accuracy", f"{s['accuracy']:.4f} (rank 0's report)"))
    rows += [(f"rank {r['rank']} said", r["last_line"] or "-") for r in s["ranks"]]
    rows += [("model saved", s["saved"])] if s.get("saved") else []
    width = max(len(k) for k, _ in rows)
    print("grpc-ps run summary", file=out)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}", file=out)
    out.flush()
