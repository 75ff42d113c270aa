"""``ps-launch``: the embedded default. Shards and workers as local processes on 127.0.0.1.

Starts S ``ps-server`` processes on free ports, then W workers: ``ps-worker`` for a built-in workload
(``ps-launch digits``), or copies of the user's own script (``ps-launch train.py [args]``,
``ps-launch -m package.module [args]``, torchrun-style) with the environment contract of
:mod:`ps_worker.env` set; shows live progress (tqdm, one bar per rank, on stderr); prints a final
summary on stdout (``--json``: one JSON object on the last line). Exits non-zero when any process
fails and never leaves a process behind: children are ended on exit, errors and Ctrl-C, and get
SIGTERM if the launcher is killed. Children start with ``GLIBC_TUNABLES`` and ``OMP_NUM_THREADS``
set (see :func:`launch_environment`) unless the user set them.

The parts: :mod:`ps_launch.target` (what each worker runs), :mod:`ps_launch.cluster`
(the processes), :mod:`ps_launch.shard_host` (a fresh job's shards forked from one process),
:mod:`ps_launch.status` (the shards' status), :mod:`ps_launch.run` (one run),
:mod:`ps_launch.summary` (its account).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Mapping, Sequence

from ps_common.flags import FlagParser, join_timeout_flag, mode_flags, otel_flag
from ps_common.modes import MODES
from ps_common.process_env import GLIBC_TUNABLES, launch_environment
from ps_launch.cluster import Child, Cluster, server_flags, tail
from ps_launch.run import run
from ps_launch.status import MembershipWatch, shard_statuses
from ps_launch.summary import (
    RankRun,
    close_bars,
    finished_version,
    mean,
    nothing_to_do,
    print_summary,
    summarize,
)
from ps_launch.target import Target, TargetError, split_argv
from ps_worker.workloads.flags import CommandParser, training_flags, workload_argument

__all__ = [
    "Child",
    "Cluster",
    "MembershipWatch",
    "RankRun",
    "Target",
    "close_bars",
    "finished_version",
    "launch_environment",
    "launch_parser",
    "main",
    "mean",
    "nothing_to_do",
    "print_summary",
    "run",
    "server_flags",
    "shard_statuses",
    "summarize",
    "tail",
]

USAGE = (
    "ps-launch [flags] [charlm|ctr|digits|linreg]\n"
    "       ps-launch [flags] train.py [script args]\n"
    "       ps-launch [flags] -m package.module [args]"
)


def launch_parser(environ: Mapping[str, str] | None = None) -> FlagParser:
    """The ``ps-launch`` flags (docs/architecture.md#10-commands-and-metrics)."""
    p = CommandParser(
        prog="ps-launch",
        usage=USAGE,
        description="Run a grpc-ps cluster and a training job on this machine: a built-in workload, or your own "
        "script (one copy per rank, with PS_SERVERS, PS_RANK, PS_NUM_WORKERS, PS_STEPS... set; see the README's "
        "'Your own training script').",
        epilog=(
            f"Every shard and worker starts with GLIBC_TUNABLES={GLIBC_TUNABLES} (malloc tuned for large "
            "messages) and OMP_NUM_THREADS=max(1, CPUs // (shards + workers)) unless you set them: a value in "
            "ps-launch's environment wins (an empty GLIBC_TUNABLES turns the tuning off). Tokens: set PS_TOKEN "
            "and PS_ADMIN_TOKEN (or PS_TOKEN_FILE and PS_ADMIN_TOKEN_FILE) in ps-launch's environment; every "
            "shard and worker gets them through its environment, never on its command line, where every user "
            "of this machine could read them (/proc/PID/cmdline, ps); with --rank-tokens a worker gets its own "
            "rank's token instead, and no other."
        ),
        environ=environ,
    )
    p.flag("--shards", type=int, default=2, help="number of shard processes")
    p.flag("--workers", type=int, default=2, help="number of worker processes")
    p.flag("--mode", default="sync", choices=MODES, help="consistency model")
    mode_flags(p)
    training_flags(p)
    p.flag("--timeout", type=float, default=60.0, help="per-RPC deadline of workers, seconds")
    p.flag("--log-dir", default="", help="directory for each process's log (default: a temporary directory)")
    p.flag(
        "--save",
        default="",
        help="after training, before the shards stop, write the model (dense and tables) to this .safetensors or .pt "
        "file (default with --log-dir: LOG_DIR/model.safetensors, or model.pt without safetensors)",
    )
    p.flag("--no-metrics", switch=True, help="serve no Prometheus /metrics from shards and workers")
    p.flag(
        "--rank-tokens",
        switch=True,
        help="a token per rank: shards get LOG_DIR/rank-tokens (0600), each worker only its own token as PS_TOKEN "
        "(no shared or admin token), so a worker cannot act as another rank (PERMISSION_DENIED WRONG_RANK); "
        "an admin token is drawn too unless PS_ADMIN_TOKEN is set",
    )
    otel_flag(p)  # passed down to every shard and worker as PS_OTEL_ENDPOINT
    p.flag("--json", switch=True, help="print the summary as one JSON object on the last line of stdout")
    p.flag("--no-progress", switch=True, help="no progress bars")
    p.flag(
        "--no-shard-host",
        switch=True,
        help="start every shard as a process of its own; by default a fresh job's shards are forked from one "
        "process that imports torch once for all of them (a resumed job's shards always start on their own)",
    )
    p.flag("--lease-timeout", type=float, default=10.0, help="seconds of silence before a shard evicts a rank")
    join_timeout_flag(p)
    p.flag(
        "--checkpoint-every",
        type=int,
        default=50,
        help="shards checkpoint every V versions into LOG_DIR/checkpoints (0: only when they stop)",
    )
    p.flag(
        "--durable-acks",
        switch=True,
        help="shards answer a push once its version is on disk (checkpoint every version): a killed shard "
        "loses nothing acknowledged, embedding-table rounds included",
    )
    p.flag(
        "--fault",
        default="",
        help="inject faults: kill-worker:R@step=N[,restart] or kill-shard:K@step=N[,restart], ';'-separated",
    )
    p.flag(
        "--resize",
        default="",
        help="resize the running job: N@step=S grows or shrinks it to N workers once a rank reaches step S "
        "(ps-admin resize N; new ranks are started, ranks beyond N stop), ';'-separated (sync, async, ssp, diloco)",
    )
    p.add_argument(
        "-m",
        dest="module",
        metavar="MODULE",
        help="run `python -m MODULE [args]` as each worker instead of a workload; the arguments after MODULE are "
        "its own",
    )
    workload_argument(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    parser = launch_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        own, target = split_argv(argv, parser)
    except TargetError as exc:
        parser.error(str(exc))
    args = parser.parse_args(own)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # Installed explicitly: a launcher started from a script may inherit SIGINT as ignored.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    return run(args, target)


if __name__ == "__main__":
    sys.exit(main())
