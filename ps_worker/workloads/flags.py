"""The flags of ``ps-worker`` and the training flags ``ps-launch`` forwards to it.

Imports neither torch nor the workloads, so ``--help`` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Mapping
from typing import NoReturn

from ps_common.channels import tls_flags
from ps_common.dataconn import DATA_PATHS
from ps_common.flags import FlagParser, otel_flag, secret_help
from ps_common.optimizer_args import OPTIMIZER_NAMES

WORKLOAD_NAMES = ("charlm", "ctr", "digits", "linreg")
"""The built-in workloads (the keys of ``ps_worker.workloads.registry.WORKLOADS``, sorted; a test keeps them equal)."""


class CommandParser(FlagParser):
    """A :class:`FlagParser` whose errors are one line and a hint, not a usage dump: a mistyped flag
    gets the closest real one (``--step``: did you mean --steps?)."""

    def error(self, message: str) -> NoReturn:
        hint = f"see {self.prog} --help"
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            words = [w.split("=")[0] for w in unknown.group(1).split()]
            close = sorted({g for w in words for g in difflib.get_close_matches(w, known, n=1, cutoff=0.75)})
            if close:
                hint = f"did you mean {' or '.join(close)}? {hint}"
        print(f"{self.prog}: {message.rstrip('.')} ({hint})", file=sys.stderr)
        sys.exit(2)


def ratio(text: str) -> float:
    """A fraction in [0, 1] (argparse type).

    Raises:
        argparse.ArgumentTypeError: not a number in [0, 1].
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1]")
    return value


def training_flags(p: FlagParser) -> None:
    """The training flags, shared by ``ps-worker`` and ``ps-launch`` (which forwards them)."""
    p.flag("--steps", type=int, default=300, help="optimizer steps (pushes) to run")
    p.flag("--batch-size", type=int, default=32, help="samples per step on this worker")
    p.flag(
        "--optimizer",
        default="sgd",
        choices=OPTIMIZER_NAMES,
        help="server-side torch.optim optimizer (sent by rank 0 at Init)",
    )
    p.flag("--lr", type=float, default=0.1, help="learning rate")
    p.flag("--momentum", type=float, default=0.9, help="momentum (sgd, rmsprop)")
    p.flag("--seed", type=int, default=0, help="seed of model initialization and data shuffling")
    p.flag("--slow-rank", type=int, default=-1, help="rank that sleeps --slow-ms before every push (straggler)")
    p.flag("--slow-ms", type=float, default=0.0, help="milliseconds the slow rank sleeps before each push")
    p.flag(
        "--init-from",
        default="",
        help="start the model from this .safetensors or .pt model file (ps-admin export, ps-launch --save): its "
        "dense parameters before Init, its embedding tables' rows seeded by rank 0 at table init",
    )
    p.flag("--corpus", default="", help="charlm: text file to train on (default: the Python standard library's source)")
    p.flag(
        "--wire-dtype",
        default="native",
        choices=("native", "bfloat16", "float16"),
        help="dtype of gradients and weights on the wire: native (each parameter's own) or bfloat16/float16 "
        "(half the bytes of float32; shards keep float32 weights and optimizer state)",
    )
    p.flag(
        "--overlap",
        switch=True,
        help="push each layer's gradient while the rest of backward runs (sync, async, ssp)",
    )
    p.flag(
        "--elastic-lr",
        default="none",
        choices=("none", "linear"),
        help="when the job is resized (ps-admin resize), keep the learning rate (none) or scale it by the "
        "worker count over the shards' --num-workers (linear scaling rule, Goyal et al. 2017)",
    )
    p.flag(
        "--topk",
        type=ratio,
        default=0.0,
        help="push only this fraction of each gradient partition, the largest entries, and keep the rest for "
        "later pushes (error feedback, Stich et al. 2018); 0 pushes dense gradients",
    )
    # TensorBoard curves (ps_worker.tensorboard)
    p.flag(
        "--tensorboard",
        default="",
        help="write TensorBoard curves into DIR/rank-R, one run per rank: loss, learning rate, step seconds, "
        "staleness, bytes, held-out scores (needs pip install 'grpc-ps[tensorboard]'; view: tensorboard --logdir DIR)",
    )
    p.flag("--tensorboard-every", type=int, default=10, help="steps between two TensorBoard points (means over them)")


def worker_parser(environ: Mapping[str, str] | None = None) -> FlagParser:
    """The ``ps-worker`` flags (docs/architecture.md#10-commands-and-metrics)."""
    p = CommandParser(
        prog="ps-worker", description="Train a built-in workload as one rank of a grpc-ps cluster.", environ=environ
    )
    p.flag("--servers", required=True, help="HOST:PORT of every shard, comma-separated, in shard-index order")
    p.flag("--rank", type=int, required=True, help="this worker's rank, 0..num_workers-1")
    p.flag("--num-workers", type=int, required=True, help="number of worker ranks")
    training_flags(p)
    p.flag("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when available)")
    p.flag("--timeout", type=float, default=60.0, help="per-RPC deadline in seconds (bounds a call, not a slow peer)")
    p.flag(
        "--wait-timeout",
        type=float,
        default=1800.0,
        help="seconds a wait for other ranks may last while they are alive (0: no bound); a silent rank is evicted",
    )
    p.flag("--incarnation", type=int, default=None, help="restart counter of this rank (default: wall-clock µs)")
    p.flag(
        "--retry-deadline",
        type=float,
        default=120.0,
        help="seconds to keep retrying an unreachable shard (backoff with jitter) before failing; covers a shard "
        "restarting from its checkpoint under load (26 s seen at 16 jobs on one host)",
    )
    p.flag("--token", default="", help=secret_help("bearer token for ParameterService", "PS_TOKEN"))
    p.flag("--token-file", default="", help="file holding the bearer token (e.g. a mounted Secret)")
    p.flag(
        "--data-path",
        default="tcp",
        choices=DATA_PATHS,
        help="tcp: PushPull's partitions (a small model's whole PushPullOnce) on the shard's data connection "
        "when it offers one (no TLS), else gRPC; grpc: always on gRPC",
    )
    tls_flags(p)
    p.flag(
        "--metrics-port",
        type=int,
        default=0,
        help="HTTP port of Prometheus /metrics; 0 (default) picks a free port and prints it on stderr, so several "
        "processes share a host; -1 turns it off",
    )
    p.flag("--metrics-host", default="127.0.0.1", help="address /metrics binds (0.0.0.0 to be scraped from outside)")
    otel_flag(p)
    p.flag("--json", switch=True, help="print the summary as one JSON object on the last line of stdout")
    p.flag("--no-progress", switch=True, help="no progress bar (there is none when stderr is not a terminal)")
    p.flag("--events", switch=True, help="print one JSON object per step on stdout (used by ps-launch)")
    p.flag("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log level")
    workload_argument(p)
    return p


def workload_argument(p: FlagParser) -> None:
    """The positional WORKLOAD (a built-in name; twin ``PS_WORKLOAD``, default digits) of ps-worker
    and ps-launch."""
    p.add_argument(
        "workload",
        nargs="?",
        default=p.environ.get("PS_WORKLOAD", "digits"),
        choices=WORKLOAD_NAMES,
        help="built-in workload [env PS_WORKLOAD]",
    )


def optimizer_spec(name: str, lr: float, momentum: float) -> dict[str, float | str]:
    """The optimizer spec a rank-0 worker sends at Init."""
    spec: dict[str, float | str] = {"name": name, "lr": lr}
    if name in ("sgd", "rmsprop") and momentum:
        spec["momentum"] = momentum
    return spec
