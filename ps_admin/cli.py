"""``ps-admin``: inspect and steer every shard of a grpc-ps cluster over ``ps.v1.Admin``
(docs/architecture.md#10-commands-and-metrics).

``status`` prints one table (``--json`` for scripts); ``top`` redraws it in 80x24 from one
``WatchStatus`` stream per shard until Ctrl-C or ``--iterations``; ``set`` changes the learning rate
and mode parameters (``UpdateConfig``) on every shard; ``checkpoint`` has every shard write a
checkpoint now (``Checkpoint``); ``evict RANK`` stops counting a rank (``EvictWorker``) on every
shard; ``export --out model.pt`` writes the shards' model as a torch.save state_dict
(``ps_admin.export``); ``reshard --from DIR --to N`` restores a stopped job's checkpoints onto N
shards, offline (no ``--servers``: :func:`run_reshard`). Exit status: 0 when every shard answered
(and accepted), 1 when one did not (one line per shard on stderr), 2 on bad flags.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import grpc

from ps_admin.client import FATAL, Reply, Watcher, checkpoint, evict_worker, fetch_all, resize, update_config
from ps_admin.export import add_export_parser, cmd_export
from ps_admin.view import STATE_NAMES, render_status, render_top, settings_lines, status_json
from ps_common import jsonout, modes
from ps_common.channels import credentials, parse_servers, tls_flags
from ps_common.flags import FlagParser, secret, secret_help
from ps_common.modes import MODES, uint32
from ps_proto.v1 import ps_pb2

SET_FLAGS = ", ".join(("--lr", "--mode", *(m.flag for m in modes.UPDATABLE)))
"""Every flag of ``set`` (its usage error lists them)."""


# ---------------------------------------------------------------------------------------- commands
def cmd_status(args: Any, out: IO[str], err: IO[str]) -> int:
    results = fetch_all(args.servers, args.admin_token, args.timeout, args.creds)
    if args.json:
        print(jsonout.dumps(status_json(results)), file=out)
    elif any(r.ok for r in results):
        print("\n".join(render_status(results)), file=out)
    for r in results:
        if not r.ok:
            print(r.error_line(), file=err)
    return 0 if all(r.ok for r in results) else 1


def cmd_top(args: Any, out: IO[str], err: IO[str]) -> int:
    tty = out.isatty()
    watcher = Watcher(args.servers, args.admin_token, args.interval, args.timeout, args.creds)
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


def update_request(args: Any) -> ps_pb2.UpdateConfigRequest:
    """The UpdateConfigRequest of the ``set`` flags given (unset flags leave their field unset)."""
    fields = modes.set_request_fields(args)
    if args.lr is not None:
        fields["learning_rate"] = args.lr
    if args.mode is not None:
        fields["mode"] = ps_pb2.Mode.Value(f"MODE_{args.mode.upper()}")
    if getattr(args, "at_version", None) is not None:
        fields["at_version"] = args.at_version
    return ps_pb2.UpdateConfigRequest(**fields)


def report(replies: Sequence[Reply], describe: Callable[[Any], str], out: IO[str], err: IO[str]) -> None:
    """One line per shard on ``out`` (``describe`` of its answer, or why there is none); each
    failure's error line on ``err``."""
    width = max(len(r.address) for r in replies)
    for r in replies:
        state = describe(r.message) if r.ok else f"failed ({r.code.name if r.code else 'ERROR'})"
        print(f"{r.address.ljust(width)}  {state if r.sent else 'not sent'}", file=out)
    for r in replies:
        if r.sent and not r.ok:
            print(r.error_line(), file=err)


def cmd_set(args: Any, out: IO[str], err: IO[str]) -> int:
    request = update_request(args)
    replies = update_config(args.servers, request, args.admin_token, args.timeout, args.creds)
    (first,) = replies
    report(
        replies,
        lambda r: (
            f"scheduled at version {r.at_version} (membership epoch {r.membership_epoch}); every shard applies it there"
        ),
        out,
        err,
    )
    if not first.ok:
        if first.code == grpc.StatusCode.DEADLINE_EXCEEDED:  # it may have scheduled the change after all
            print("ps-admin: set: shard 0 may have scheduled the change; `ps-admin status` shows it.", file=err)
        else:
            print("ps-admin: set: nothing changed.", file=err)
        return 1
    for line in settings_lines([(first.address, first.message.config, first.message.pending_mode)]):
        print(line, file=out)
    return 0


def cmd_resize(args: Any, out: IO[str], err: IO[str]) -> int:
    reply = resize(args.servers, args.num_workers, args.at_version, args.admin_token, args.timeout, args.creds)

    def describe(r: ps_pb2.ResizeResponse) -> str:
        if r.previous_num_workers == r.num_workers:
            return f"already {r.num_workers} workers"
        return (
            f"{r.previous_num_workers} -> {r.num_workers} workers from version {r.at_version} "
            f"(membership epoch {r.membership_epoch}); every shard follows"
        )

    report([reply], describe, out, err)
    return 0 if reply.ok else 1


def cmd_checkpoint(args: Any, out: IO[str], err: IO[str]) -> int:
    replies = checkpoint(args.servers, args.admin_token, args.timeout, args.creds)

    def describe(reply: ps_pb2.CheckpointResponse) -> str:
        return f"version {reply.version} written in {reply.seconds:.3f} s: {reply.path}"

    report(replies, describe, out, err)
    return 0 if all(r.ok for r in replies) else 1


def cmd_evict(args: Any, out: IO[str], err: IO[str]) -> int:
    replies = evict_worker(args.servers, args.rank, args.admin_token, args.timeout, args.creds)

    def describe(reply: ps_pb2.EvictWorkerResponse) -> str:
        previous = STATE_NAMES.get(reply.previous_state, "?")
        if previous in ("live", "pending"):
            return f"rank {args.rank} {previous} -> evicted (version {reply.version})"
        return f"rank {args.rank} already {previous} (version {reply.version})"

    report(replies, describe, out, err)
    return 0 if all(r.ok for r in replies) else 1


# ---------------------------------------------------------------------------------------- flags
def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"{text} is not > 0")
    return value


def add_set_flags(p: FlagParser) -> None:
    """``set``'s flags. Their twins are ``PS_SET_*``: ``PS_LR``, ``PS_MODE``, … configure workers
    and shards, and must not turn into changes when ``ps-admin`` runs beside them."""

    def flag(name: str, help: str, **kw: Any) -> None:
        p.flag(name, help=f"set: {help}", env="PS_SET_" + name.lstrip("-").upper().replace("-", "_"), **kw)

    flag("--lr", "learning rate of the shards' optimizer", type=float)
    flag(
        "--mode",
        "switch the consistency model at the next sync round boundary (not into or out of easgd)",
        choices=MODES,
    )
    for m in modes.UPDATABLE:
        flag(m.flag, m.set_help, type=m.set_type, choices=m.set_choices)
    flag("--at-version", "the version every shard applies the change at (default: shard 0's next round)", type=uint32)


def admin_parser(environ: Mapping[str, str] | None = None) -> FlagParser:
    """The ``ps-admin`` flags (docs/architecture.md#10-commands-and-metrics)."""
    p = FlagParser(
        prog="ps-admin",
        description="Inspect and steer every shard of a grpc-ps cluster. Offline: `ps-admin reshard --from DIR "
        "--to N` restores a stopped job's checkpoints onto N shards (see `ps-admin reshard --help`).",
        environ=environ,
    )
    p.flag("--servers", required=True, help="HOST:PORT of every shard, comma-separated, in shard-index order")
    p.flag(
        "--admin-token",
        default="",
        help=secret_help("bearer token of ps.v1.Admin (the shards' PS_ADMIN_TOKEN)", "PS_ADMIN_TOKEN"),
    )
    p.flag("--admin-token-file", default="", help="file holding the admin token (e.g. a mounted Secret)")
    p.flag("--timeout", type=positive, default=5.0, help="deadline of each call, seconds")
    tls_flags(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="{status,top,set,resize,checkpoint,evict,export}")
    status = sub.add_parser("status", help="print every shard's status once", environ=p.environ)
    status.flag("--json", switch=True, help="status: print one JSON object for scripts")
    top = sub.add_parser("top", help="refresh the status table until Ctrl-C", environ=p.environ)
    top.flag("--interval", type=positive, default=2.0, help="top: seconds between refreshes (0.1 to 3600)")
    top.flag("--iterations", type=int, default=0, help="top: exit after this many frames (0: until Ctrl-C)")
    change = sub.add_parser(
        "set",
        help="change the learning rate, mode parameters or mode on every shard at one version (shard 0 schedules it)",
        environ=p.environ,
    )
    add_set_flags(change)
    grow = sub.add_parser(
        "resize",
        help="grow or shrink a running job to N workers at a round boundary (sync, async, ssp, diloco)",
        environ=p.environ,
    )
    grow.add_argument("num_workers", type=uint32, metavar="N", help="ranks 0..N-1 make up the job from the resize on")
    grow.add_argument(
        "--at-version", type=uint32, default=None, help="the version (sync: round) it holds from (default: the next)"
    )
    sub.add_parser(
        "checkpoint",
        help="write a checkpoint on every shard now (shards started with --checkpoint-dir)",
        environ=p.environ,
    )
    evict = sub.add_parser("evict", help="stop counting a rank on every shard (shard 0 decides)", environ=p.environ)
    evict.add_argument("rank", type=uint32, metavar="RANK", help="the rank to evict; it may rejoin with a restart")
    add_export_parser(sub, p.environ)  # ps_admin.export
    p.twins += status.twins + top.twins + change.twins  # one list of every flag and twin of the command
    change.set_defaults(set_usage_error=change.error)
    return p


COMMANDS: dict[str, Callable[[Any, IO[str], IO[str]], int]] = {
    "status": cmd_status,
    "top": cmd_top,
    "set": cmd_set,
    "resize": cmd_resize,
    "checkpoint": cmd_checkpoint,
    "evict": cmd_evict,
    "export": cmd_export,
}


RESHARD_MODULE = "ps_server.checkpoint.reshard_cli"
"""What ``ps-admin reshard`` runs: the checkpoint format is the server's (ps_admin imports no
server code, nor torch), so the command runs that module in a child Python of this interpreter."""


def run_reshard(argv: Sequence[str]) -> int:
    """``ps-admin reshard --from DIR --to N [--out DIR2] [--version V]``: offline, on a stopped job's
    checkpoint directory (docs/operations.md#reshard-restore-a-job-onto-another-shard-count).
    Returns the child's exit status (0 done, 1 refused and nothing written, 2 bad flags)."""
    return subprocess.run([sys.executable, "-m", RESHARD_MODULE, *argv], check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["reshard"]:  # offline: no shard to talk to, so none of the flags below
        return run_reshard(argv[1:])
    parser = admin_parser()
    args = parser.parse_args(argv)
    try:
        args.servers = parse_servers(args.servers)
        args.admin_token = secret(args.admin_token, args.admin_token_file, "--admin-token")
    except ValueError as exc:
        parser.error(str(exc))
    try:
        args.creds = credentials(args.tls_ca, args.tls_cert, args.tls_key)
    except ValueError as exc:
        parser.error(str(exc))
    except OSError as exc:
        parser.error(f"Cannot read the TLS file {exc.filename!r}: {exc.strerror}.")
    if args.command == "top":
        if args.iterations < 0:
            parser.error(f"--iterations must be >= 0, got {args.iterations}.")
        if not 0.1 <= args.interval <= 3600:
            parser.error(f"--interval must be from 0.1 to 3600 seconds, got {args.interval:g}.")
        return cmd_top(args, sys.stdout, sys.stderr)
    if args.command == "set" and not (args.lr is not None or args.mode is not None or modes.set_request_fields(args)):
        args.set_usage_error(f"set needs at least one change: {SET_FLAGS}.")
    try:
        return COMMANDS[args.command](args, sys.stdout, sys.stderr)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
