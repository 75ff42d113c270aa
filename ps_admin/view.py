"""How ``ps-admin`` shows shards: the status tables, the settings in force, ``top`` frames and ``--json``.

Pure formatting of ``ps.v1`` messages: no calls, no clocks except the one passed in.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.json_format import MessageToDict

from ps_admin.client import ShardResult
from ps_admin.tables_view import table_lines
from ps_common import modes
from ps_proto.v1 import ps_pb2

STATE_NAMES = {
    ps_pb2.WORKER_STATE_UNSPECIFIED: "?",
    ps_pb2.WORKER_STATE_PENDING: "pending",
    ps_pb2.WORKER_STATE_LIVE: "live",
    ps_pb2.WORKER_STATE_EVICTED: "evicted",
    ps_pb2.WORKER_STATE_LEFT: "left",
}

ROUND_NOTE_SECONDS = 1.0
"""A sync round open this long is shown (ranks it waits for); shorter ones are ordinary."""


# ---------------------------------------------------------------------------------------- small pieces
def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def span(values: Sequence[int]) -> str:
    """``[3, 3]`` -> ``3``; ``[2, 3]`` -> ``2..3``; ``[]`` -> ``-``."""
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}..{hi}"


def mode_text(mode: int) -> str:
    """``MODE_SYNC`` -> ``sync``; ``MODE_UNSPECIFIED`` -> ``""``."""
    return "" if mode == ps_pb2.MODE_UNSPECIFIED else ps_pb2.Mode.Name(mode).removeprefix("MODE_").lower()


def mode_name(status: ps_pb2.ShardStatus) -> str:
    return mode_text(status.config.mode)


def live_clocks(status: ps_pb2.ShardStatus) -> list[int]:
    return [w.clock for w in status.workers if w.state == ps_pb2.WORKER_STATE_LIVE]


def clock_gap(status: ps_pb2.ShardStatus) -> int | None:
    """Largest clock difference between live ranks (the ssp bound caps it), or None with none live."""
    clocks = live_clocks(status)
    return max(clocks) - min(clocks) if clocks else None


# ---------------------------------------------------------------------------------------- settings in force
def settings_text(config: ps_pb2.ClusterConfig) -> str:
    """The learning rate and the parameters of the mode in force: ``lr 0.05, sync quorum all, round timeout off``."""
    mode = mode_text(config.mode)
    lr = f"{config.learning_rate:g}" if config.learning_rate else "-"  # 0: not initialized yet (no optimizer)
    return f"lr {lr}, {mode} {modes.parameters_text(config, mode)}"


def pending_text(config: ps_pb2.ClusterConfig, pending_mode: int) -> str:
    """``ssp at the next round boundary (staleness 1)``, or ``""`` when no switch is pending."""
    pending = mode_text(pending_mode)
    return f"{pending} at the next round boundary ({modes.parameters_text(config, pending)})" if pending else ""


def settings_lines(shards: Sequence[tuple[str, ps_pb2.ClusterConfig, int]]) -> list[str]:
    """``settings: …`` (and ``pending: …``) once when every shard agrees, else labelled per shard.

    Args:
        shards: (label, config in force, pending mode) of each shard that answered.
    """
    texts = [(label, settings_text(c), pending_text(c, p)) for label, c, p in shards]
    agree = len({t[1:] for t in texts}) == 1
    lines = []
    for label, settings, pending in texts[:1] if agree else texts:
        tag = "" if agree else f" {label}"
        lines += [f"settings{tag}: {settings}", *([f"pending{tag}: {pending}"] if pending else [])]
    return lines


def membership_line(results: Sequence[ShardResult]) -> str | None:
    """``membership: epoch E (shard 0 decides), 3 workers; scheduled: ... at version V`` from the
    first shard that answered, or None before any decision."""
    status = next((r.status for r in results if r.status), None)
    if status is None or not status.membership.epoch:
        return None
    m = status.membership
    applied = {c.epoch for c in status.applied_changes}
    pending = [c for c in m.config_changes if c.epoch not in applied]
    text = f"membership: epoch {m.epoch} ({m.reason}), {m.num_workers} workers"
    if pending:
        text += "; scheduled: " + ", ".join(f"a change at version {c.version}" for c in pending)
    return text


def status_settings(results: Sequence[ShardResult]) -> list[str]:
    """:func:`settings_lines` of the shards that answered."""
    return settings_lines(
        [(f"{s.shard_index}/{s.num_shards}", s.config, s.pending_mode) for s in (r.status for r in results) if s]
    )


# ---------------------------------------------------------------------------------------- tables
@dataclass(frozen=True)
class Column:
    """A table column; when the table is too wide, columns of the lowest ``keep`` go first."""

    title: str
    keep: int
    right: bool = False


def table(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int | None = None) -> list[str]:
    """Rows under a header, two spaces apart; drops low-``keep`` columns until it fits ``width``."""
    cols = list(range(len(columns)))

    def widths(chosen: list[int]) -> dict[int, int]:
        return {c: max([len(columns[c].title), *(len(r[c]) for r in rows)]) for c in chosen}

    w = widths(cols)
    while width is not None and len(cols) > 1 and sum(w.values()) + 2 * (len(cols) - 1) > width:
        cols.remove(min(cols, key=lambda c: (columns[c].keep, -c)))
        w = widths(cols)

    def line(cells: Sequence[str]) -> str:
        parts = [cells[c].rjust(w[c]) if columns[c].right else cells[c].ljust(w[c]) for c in cols]
        return "  ".join(parts).rstrip()

    return [line([c.title for c in columns]), *(line(r) for r in rows)]


SHARD_COLUMNS = (
    Column("SHARD", 10),
    Column("ADDRESS", 2),
    Column("MODE", 9),
    Column("VERSION", 10, right=True),
    Column("LIVE", 8),
    Column("CLOCKS", 6),
    Column("GAP", 5, right=True),
    Column("STALENESS", 7, right=True),
    Column("REFUSED", 7),
    Column("RECV", 4, right=True),
    Column("SENT", 4, right=True),
    Column("REJ", 3, right=True),
    Column("INIT", 3),
    Column("PLAN", 1),
)

RANK_COLUMNS = (
    Column("RANK", 9, right=True),
    Column("STATE", 8),
    Column("CLOCK", 7, right=True),
    Column("PUSHES", 5, right=True),
    Column("SEEN", 4, right=True),
    Column("ROUND", 6),
    Column("INCARNATION", 1, right=True),
)


def staleness_cell(summary: ps_pb2.StalenessSummary, mode: str = "") -> str:
    """``p50/p90/max`` of applied pushes in versions behind, ``-`` before any; ``0`` in sync mode,
    where every gradient is applied to the version it was computed on."""
    if mode == "sync":
        return "0"
    return f"{summary.p50:g}/{summary.p90:g}/{summary.max}" if summary.count else "-"


def refused_cell(rejected: dict[str, int] | Any) -> str:
    """``late:2,stale:5`` (pushes refused or dropped by reason), ``0`` when none."""
    counts = {reason: n for reason, n in sorted(dict(rejected).items()) if n}
    return ",".join(f"{reason}:{n}" for reason, n in counts.items()) or "0"


def shard_rows(results: Sequence[ShardResult]) -> list[list[str]]:
    rows = []
    for r in results:
        s = r.status
        if s is None:
            rows.append([f"?/{len(results)}", r.address, "down", *["-"] * (len(SHARD_COLUMNS) - 3)])
            continue
        gap = clock_gap(s)
        rows.append(
            [
                f"{s.shard_index}/{s.num_shards}",
                r.address,
                mode_name(s),
                str(s.version),
                f"{len(live_clocks(s))}/{s.config.num_workers}",
                span(live_clocks(s)),
                "-" if gap is None else str(gap),
                staleness_cell(s.staleness, mode_name(s)),
                refused_cell(s.rejected_pushes),
                human_bytes(s.received_bytes),
                human_bytes(s.sent_bytes),
                str(s.rejected_requests),
                "yes" if s.initialized else "no",
                s.plan_digest[:8] or "-",
            ]
        )
    return rows


def round_cell(rank: int, statuses: Sequence[ps_pb2.ShardStatus]) -> str:
    """``in`` (its push is held by the open round), ``missing 3.2s`` (the round waits for it), ``-``."""
    waited = [s.round_age_seconds for s in statuses if rank in s.round_waiting_for and s.round_age_seconds > 0]
    if waited:
        return f"missing {max(waited):.1f}s"
    return "in" if any(rank in s.round_ranks for s in statuses) else "-"


def rank_rows(results: Sequence[ShardResult]) -> list[list[str]]:
    """One row per rank, merged over shards: states joined with '/' where shards disagree."""
    statuses = [r.status for r in results if r.status is not None]
    by_rank: dict[int, list[ps_pb2.WorkerStatus]] = {}
    for s in statuses:
        for w in s.workers:
            by_rank.setdefault(w.rank, []).append(w)
    rows = []
    for rank in sorted(by_rank):
        ws = by_rank[rank]
        states = list(dict.fromkeys(STATE_NAMES.get(w.state, "?") for w in ws))
        seen = [w.last_seen_seconds_ago for w in ws if w.last_seen_seconds_ago >= 0]
        rows.append(
            [
                str(rank),
                "/".join(states),
                span([w.clock for w in ws]),
                str(max(w.pushes for w in ws)),
                f"{min(seen):.1f}s" if seen else "never",
                round_cell(rank, statuses),
                span([w.incarnation for w in ws]),
            ]
        )
    return rows


# ---------------------------------------------------------------------------------------- whole views
def summary_line(results: Sequence[ShardResult]) -> str:
    ok = [r.status for r in results if r.status is not None]
    if not ok:
        return f"grpc-ps: 0 of {len(results)} shards answered"
    modes = sorted({mode_name(s) for s in ok})
    live = min(len(live_clocks(s)) for s in ok)
    gaps = [g for g in (clock_gap(s) for s in ok) if g is not None]
    return (
        f"grpc-ps: {len(ok)}/{len(results)} shards, mode {'/'.join(modes)}, version "
        f"{span([s.version for s in ok])}, workers {live}/{ok[0].config.num_workers} live"
        + (f", clock gap {max(gaps)}" if gaps else "")
    )


def round_line(results: Sequence[ShardResult]) -> str | None:
    """``sync round open 3.2s, waiting for rank 1; …`` when a round has been open a while, else None."""
    ok = [r.status for r in results if r.status is not None]
    age = max((s.round_age_seconds for s in ok), default=0.0)
    if age < ROUND_NOTE_SECONDS:
        return None
    waiting = sorted({rank for s in ok for rank in s.round_waiting_for})
    if not waiting:
        return f"sync round open {age:.1f}s"
    ranks = ",".join(map(str, waiting))
    what = f"rank {ranks}; if it is gone: ps-admin evict {ranks}" if len(waiting) == 1 else f"ranks {ranks}"
    return f"sync round open {age:.1f}s, waiting for {what}"


def checkpoint_lines(results: Sequence[ShardResult]) -> list[str]:
    """``! shard 0: 3 checkpoint writes failed, the newest: Cannot write …`` per shard whose newest
    checkpoint write failed; nothing while the newest write of every shard succeeded."""
    return [
        f"! shard {s.shard_index}: {s.checkpoint_failures} checkpoint write(s) failed, the newest: "
        f"{s.last_checkpoint_error}"
        for s in (r.status for r in results)
        if s is not None and s.last_checkpoint_error
    ]


def render_status(results: Sequence[ShardResult], width: int | None = None, errors: bool = False) -> list[str]:
    """The ``status`` report: a summary line, the settings in force, failing checkpoints, the shard
    table (``errors``: a line under it per shard that did not answer) and the rank table."""
    membership = membership_line(results)
    lines = [summary_line(results), *status_settings(results), *([membership] if membership else [])]
    note = round_line(results)
    if note:
        lines.append(note)
    lines += checkpoint_lines(results)
    lines += table_lines(results)
    lines += ["", *table(SHARD_COLUMNS, shard_rows(results), width)]
    if errors:
        lines += [f"! {r.error_line().removeprefix('ps-admin: ')}" for r in results if not r.ok]
    ranks = rank_rows(results)
    if ranks:
        lines += ["", *table(RANK_COLUMNS, ranks, width)]
    return lines


def render_top(results: Sequence[ShardResult], width: int, height: int, interval: float, now: float) -> list[str]:
    """One ``top`` frame: at most ``height - 1`` lines of at most ``width`` columns."""
    clock = time.strftime("%H:%M:%S", time.localtime(now))
    title = f"ps-admin top  {clock}  every {interval:g}s  Ctrl-C quits"
    lines = [title, *render_status(results, width, errors=True)]
    limit = max(1, height - 1)
    if len(lines) > limit:
        hidden = len(lines) - (limit - 1)
        lines = [*lines[: limit - 1], f"... {hidden} more lines (a taller terminal shows them)"]
    return [line[:width] for line in lines]


def status_json(results: Sequence[ShardResult]) -> dict[str, Any]:
    """``status --json``: every shard's status as proto JSON (field names as in ps.proto) with the
    settings in force spelled out, or its error."""
    shards = []
    for r in results:
        s = r.status
        if s is None:
            shards.append(
                {"address": r.address, "ok": False, "code": r.code.name if r.code else None, "details": r.details}
            )
            continue
        mode = mode_name(s)
        shards.append(
            {
                "address": r.address,
                "ok": True,
                "mode": mode,
                "pending_mode": mode_text(s.pending_mode) or None,
                "learning_rate": s.config.learning_rate,
                "mode_parameters": modes.parameters_json(s.config, mode),
                "live_workers": len(live_clocks(s)),
                "clock_gap": clock_gap(s),
                "staleness": {
                    "count": s.staleness.count,
                    "p50": s.staleness.p50,
                    "p90": s.staleness.p90,
                    "max": s.staleness.max,
                },
                "rejected_pushes": dict(sorted(s.rejected_pushes.items())),
                "status": MessageToDict(s, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
            }
        )
    return {"ok": all(r.ok for r in results), "shards": shards}
