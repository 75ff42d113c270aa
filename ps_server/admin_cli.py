"""``ps-admin``: one view of every shard of a grpc-ps cluster over ``ps.v1.Admin`` (DESIGN section 10).

``ps-admin --servers H:P,H:P status`` prints one table (``--json`` for scripts); ``top`` redraws it
every ``--interval`` seconds in 80x24 until Ctrl-C or ``--iterations``. Exit status: 0 when every
shard answered, 1 when one did not (one line per shard on stderr), 2 on bad flags.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import IO, Any

import grpc
from google.protobuf.json_format import MessageToDict

from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_server.flags import FlagParser

FATAL = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
"""Codes no retry cures: ``top`` stops at once on them."""

HINTS = {
    grpc.StatusCode.UNAUTHENTICATED: "pass --admin-token or set PS_ADMIN_TOKEN",
    grpc.StatusCode.PERMISSION_DENIED: "Admin needs the admin token (PS_ADMIN_TOKEN), not the worker token",
    grpc.StatusCode.UNAVAILABLE: "is the shard running? check --servers",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the shard did not answer within --timeout",
}

STATE_NAMES = {
    ps_pb2.WORKER_STATE_UNSPECIFIED: "?",
    ps_pb2.WORKER_STATE_PENDING: "pending",
    ps_pb2.WORKER_STATE_LIVE: "live",
    ps_pb2.WORKER_STATE_EVICTED: "evicted",
    ps_pb2.WORKER_STATE_LEFT: "left",
}


# ---------------------------------------------------------------------------------------- fetching
@dataclass(frozen=True)
class ShardResult:
    """What one address answered: a status, or the error of its call."""

    position: int
    address: str
    status: ps_pb2.ShardStatus | None = None
    code: grpc.StatusCode | None = None
    details: str = ""

    @property
    def ok(self) -> bool:
        return self.status is not None

    def error_line(self) -> str:
        """``ps-admin: ADDRESS: CODE: details (hint)`` on one line."""
        code = self.code.name if self.code else "ERROR"
        details = " ".join(self.details.split()) or "no details"
        hint = HINTS.get(self.code) if self.code else None
        return f"ps-admin: {self.address}: {code}: {details}" + (f" ({hint})" if hint else "")


def failure(position: int, address: str, exc: grpc.RpcError) -> ShardResult:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return ShardResult(position, address, code=code, details=details or "")


def metadata_of(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying ``authorization: Bearer <token>`` (none for an empty token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def get_status(
    stub: ps_pb2_grpc.AdminStub, *, metadata: Sequence[tuple[str, str]] = (), timeout: float = 5.0
) -> ps_pb2.ShardStatus:
    """One shard's status (``Admin/GetStatus``).

    Raises:
        grpc.RpcError: the call failed (UNAVAILABLE, UNAUTHENTICATED, ...).
    """
    return stub.GetStatus(ps_pb2.GetStatusRequest(), timeout=timeout, metadata=metadata).status


def watch(
    stub: ps_pb2_grpc.AdminStub,
    interval: float,
    *,
    metadata: Sequence[tuple[str, str]] = (),
    timeout: float = 5.0,
    stop: threading.Event | None = None,
) -> Iterator[ps_pb2.ShardStatus]:
    """One shard's status now and then about every ``interval`` seconds, until ``stop`` is set.

    This polls ``Admin/GetStatus``; it is the one place to switch to the ``Admin/WatchStatus``
    server stream.

    Raises:
        grpc.RpcError: a call failed; the caller decides whether to watch again.
    """
    stop = stop or threading.Event()
    while not stop.is_set():
        yield get_status(stub, metadata=metadata, timeout=timeout)
        stop.wait(interval)


def fetch_all(addresses: Sequence[str], token: str, timeout: float) -> list[ShardResult]:
    """Every shard's status, asked in parallel; failures are results too."""
    metadata = metadata_of(token)
    channels = [grpc.insecure_channel(a) for a in addresses]
    try:

        def one(k: int) -> ShardResult:
            try:
                status = get_status(ps_pb2_grpc.AdminStub(channels[k]), metadata=metadata, timeout=timeout)
            except grpc.RpcError as exc:
                return failure(k, addresses[k], exc)
            return ShardResult(k, addresses[k], status)

        with futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(addresses)))) as pool:
            return list(pool.map(one, range(len(addresses))))
    finally:
        for ch in channels:
            ch.close()


class Watcher:
    """The latest result of every shard, kept fresh by one :func:`watch` thread per shard.

    Args:
        addresses: ``host:port`` of every shard.
        token: admin token, or empty.
        interval: seconds between statuses of one shard.
        timeout: per-call deadline in seconds.
    """

    def __init__(self, addresses: Sequence[str], token: str, interval: float, timeout: float) -> None:
        self.addresses = list(addresses)
        self.interval = interval
        self.timeout = timeout
        self.metadata = metadata_of(token)
        self.stop = threading.Event()
        self.changed = threading.Condition()
        self.latest: dict[int, ShardResult] = {}
        self._channels = [grpc.insecure_channel(a) for a in self.addresses]
        self._threads = [
            threading.Thread(target=self._follow, args=(k,), name=f"ps-admin-watch-{k}", daemon=True)
            for k in range(len(self.addresses))
        ]
        for t in self._threads:
            t.start()

    def _put(self, result: ShardResult) -> None:
        with self.changed:
            self.latest[result.position] = result
            self.changed.notify_all()

    def _follow(self, k: int) -> None:
        stub = ps_pb2_grpc.AdminStub(self._channels[k])
        while not self.stop.is_set():
            try:
                for status in watch(stub, self.interval, metadata=self.metadata, timeout=self.timeout, stop=self.stop):
                    self._put(ShardResult(k, self.addresses[k], status))
            except grpc.RpcError as exc:
                if self.stop.is_set():
                    return
                self._put(failure(k, self.addresses[k], exc))
                self.stop.wait(self.interval)
            except ValueError:  # the channel was closed under us while stopping
                return

    def wait_all(self, deadline: float) -> None:
        """Block until every shard has answered once or ``deadline`` (monotonic seconds) passes."""
        with self.changed:
            self.changed.wait_for(
                lambda: len(self.latest) == len(self.addresses), timeout=max(0.0, deadline - time.monotonic())
            )

    def snapshot(self) -> list[ShardResult]:
        """One result per address, in ``--servers`` order (``waiting`` for shards not heard yet)."""
        with self.changed:
            return [
                self.latest.get(k, ShardResult(k, a, code=None, details="waiting for the first answer"))
                for k, a in enumerate(self.addresses)
            ]

    def close(self) -> None:
        self.stop.set()
        for ch in self._channels:
            ch.close()
        for t in self._threads:
            t.join(timeout=self.timeout + 1)


# ---------------------------------------------------------------------------------------- formatting
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


def mode_name(status: ps_pb2.ShardStatus) -> str:
    return ps_pb2.Mode.Name(status.config.mode).removeprefix("MODE_").lower()


def live_clocks(status: ps_pb2.ShardStatus) -> list[int]:
    return [w.clock for w in status.workers if w.state == ps_pb2.WORKER_STATE_LIVE]


def clock_gap(status: ps_pb2.ShardStatus) -> int | None:
    """Largest clock difference between live ranks (the ssp bound caps it), or None with none live."""
    clocks = live_clocks(status)
    return max(clocks) - min(clocks) if clocks else None


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
    Column("SHARD", 9),
    Column("ADDRESS", 2),
    Column("MODE", 8),
    Column("VERSION", 9, right=True),
    Column("LIVE", 8),
    Column("CLOCKS", 7),
    Column("GAP", 6, right=True),
    Column("RECV", 5, right=True),
    Column("SENT", 5, right=True),
    Column("REJ", 3, right=True),
    Column("INIT", 4),
    Column("PLAN", 1),
)

RANK_COLUMNS = (
    Column("RANK", 9, right=True),
    Column("STATE", 8),
    Column("CLOCK", 7, right=True),
    Column("PUSHES", 5, right=True),
    Column("SEEN", 4, right=True),
    Column("INCARNATION", 1, right=True),
)


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
                human_bytes(s.received_bytes),
                human_bytes(s.sent_bytes),
                str(s.rejected_requests),
                "yes" if s.initialized else "no",
                s.plan_digest[:8] or "-",
            ]
        )
    return rows


def rank_rows(results: Sequence[ShardResult]) -> list[list[str]]:
    """One row per rank, merged over shards: states joined with '/' where shards disagree."""
    by_rank: dict[int, list[ps_pb2.WorkerStatus]] = {}
    for r in results:
        for w in r.status.workers if r.status else ():
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
                span([w.incarnation for w in ws]),
            ]
        )
    return rows


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


def render_status(results: Sequence[ShardResult], width: int | None = None, errors: bool = False) -> list[str]:
    """The ``status`` report: a summary line, the shard table (``errors``: a line under it per shard
    that did not answer) and the rank table."""
    lines = [summary_line(results), "", *table(SHARD_COLUMNS, shard_rows(results), width)]
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
    """``status --json``: every shard's status as proto JSON (field names as in ps.proto), or its error."""
    shards = []
    for r in results:
        if r.status is None:
            shards.append(
                {"address": r.address, "ok": False, "code": r.code.name if r.code else None, "details": r.details}
            )
            continue
        gap = clock_gap(r.status)
        shards.append(
            {
                "address": r.address,
                "ok": True,
                "mode": mode_name(r.status),
                "live_workers": len(live_clocks(r.status)),
                "clock_gap": gap,
                "status": MessageToDict(
                    r.status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
                ),
            }
        )
    return {"ok": all(r.ok for r in results), "shards": shards}


# ---------------------------------------------------------------------------------------- commands
def cmd_status(args: Any, out: IO[str], err: IO[str]) -> int:
    results = fetch_all(args.servers, args.admin_token, args.timeout)
    if args.json:
        print(json.dumps(status_json(results)), file=out)
    elif any(r.ok for r in results):
        print("\n".join(render_status(results)), file=out)
    for r in results:
        if not r.ok:
            print(r.error_line(), file=err)
    return 0 if all(r.ok for r in results) else 1


def cmd_top(args: Any, out: IO[str], err: IO[str]) -> int:
    tty = out.isatty()
    watcher = Watcher(args.servers, args.admin_token, args.interval, args.timeout)
    frames = 0
    try:
        watcher.wait_all(time.monotonic() + args.timeout + 1)
        if tty:
            out.write("\x1b[?25l\x1b[2J")
        while True:
            results = watcher.snapshot()
            fatal = [r for r in results if r.code in FATAL]
            if fatal:
                for r in fatal:
                    print(r.error_line(), file=err)
                return 1
            size = shutil.get_terminal_size((80, 24))
            lines = render_top(results, size.columns, size.lines, args.interval, time.time())
            if tty:
                out.write("\x1b[H" + "\n".join(line + "\x1b[K" for line in lines) + "\x1b[J")
            else:
                out.write("\n".join(lines) + "\n\n")
            out.flush()
            frames += 1
            if args.iterations and frames >= args.iterations:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        if tty:
            out.write("\x1b[?25h\n")
            out.flush()
        watcher.close()


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"{text} is not > 0")
    return value


def admin_parser(environ: Mapping[str, str] | None = None) -> FlagParser:
    """The ``ps-admin`` flags (DESIGN section 10)."""
    p = FlagParser(prog="ps-admin", description="Inspect every shard of a grpc-ps cluster.", environ=environ)
    p.flag("--servers", required=True, help="HOST:PORT of every shard, comma-separated, in shard-index order")
    p.flag("--admin-token", default="", help="bearer token of ps.v1.Admin (the shards' PS_ADMIN_TOKEN)")
    p.flag("--timeout", type=positive, default=5.0, help="deadline of each call, seconds")
    sub = p.add_subparsers(dest="command", required=True, metavar="{status,top}")
    status = sub.add_parser("status", help="print every shard's status once", environ=p.environ)
    status.flag("--json", switch=True, help="status: print one JSON object for scripts")
    top = sub.add_parser("top", help="refresh the status table until Ctrl-C", environ=p.environ)
    top.flag("--interval", type=positive, default=2.0, help="top: seconds between refreshes")
    top.flag("--iterations", type=int, default=0, help="top: exit after this many frames (0: until Ctrl-C)")
    p.twins += status.twins + top.twins  # one list of every flag and twin of the command
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    parser = admin_parser()
    args = parser.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not args.servers:
        parser.error("--servers needs at least one HOST:PORT.")
    if args.command == "top":
        if args.iterations < 0:
            parser.error(f"--iterations must be >= 0, got {args.iterations}.")
        return cmd_top(args, sys.stdout, sys.stderr)
    try:
        return cmd_status(args, sys.stdout, sys.stderr)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
