"""What ps-launch runs as each worker: a built-in workload, the user's script, or a module.

``ps-launch [flags] digits`` runs ``ps-worker``; ``ps-launch [flags] train.py [script args]`` and
``ps-launch [flags] -m package.module [args]`` (torchrun-style) run ``python train.py ...`` once per
rank with the environment contract of :mod:`ps_worker.env` set (``PS_SERVERS``, ``PS_RANK``,
``PS_NUM_WORKERS``, ``PS_STEPS``...) and torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``. Everything after the script or module goes to it.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ps_worker.workloads.flags import WORKLOAD_NAMES


@dataclass(frozen=True)
class Target:
    """A user's script (``kind="script"``, ``name``: its path) or module (``kind="module"``) and its
    arguments."""

    kind: str
    name: str
    args: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """How the summary names it: ``train.py`` or ``-m package.module``."""
        return self.name if self.kind == "script" else f"-m {self.name}"

    def command(self) -> tuple[list[str], tuple[str, ...]]:
        """(argv after the interpreter's own arguments, the interpreter's arguments) of one copy."""
        if self.kind == "module":
            return [self.name, *self.args], ("-m",)
        return [str(Path(self.name).resolve()), *self.args], ()


class TargetError(ValueError):
    """A script that does not exist, or ``-m`` without a module."""


def _takes_value(parser: argparse.ArgumentParser, token: str) -> bool:
    action = parser._option_string_actions.get(token)  # noqa: SLF001 - argparse has no public lookup
    return action is not None and action.nargs != 0


def is_script(token: str) -> bool:
    """A positional that names a script (``*.py``, or an existing file), not a built-in workload."""
    return token not in WORKLOAD_NAMES and (token.endswith(".py") or os.path.isfile(token))


def split_argv(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], Target | None]:
    """Split ps-launch's command line into its own flags and the user's target: the first positional
    that is a script (see :func:`is_script`), or ``-m MODULE``, ends ps-launch's flags; the rest is
    the target's. A built-in workload name does not end them (``ps-launch digits --steps 5`` works).

    Returns:
        (ps-launch's arguments, the target or None for a built-in workload).

    Raises:
        TargetError: ``-m`` with no module, or a ``*.py`` script that does not exist.
    """
    argv = list(argv)
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            if i + 1 < len(argv) and is_script(argv[i + 1]):
                return argv[:i], _script(argv[i + 1], argv[i + 2 :])
            return argv, None
        if token in ("-m", "--module"):
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise TargetError("-m needs a module: ps-launch [flags] -m package.module [args]")
            return argv[:i], Target("module", argv[i + 1], tuple(argv[i + 2 :]))
        if token.startswith("-"):
            i += 2 if "=" not in token and _takes_value(parser, token) else 1
            continue
        if is_script(token):
            return argv[:i], _script(token, argv[i + 1 :])
        i += 1
    return argv, None


def _script(path: str, args: Sequence[str]) -> Target:
    if not os.path.isfile(path):
        raise TargetError(
            f"script {path!r} not found (a path to a Python file, or a built-in workload: {', '.join(WORKLOAD_NAMES)})"
        )
    return Target("script", path, tuple(args))


def script_environment(args: Any, addresses: Sequence[str], rank: int) -> dict[str, str]:
    """The environment contract (:data:`ps_worker.env.CONTRACT`) of rank ``rank``'s copy of the user's
    script: the shards' addresses, rank, workers and the training flags ps-launch was given. Tokens and
    TLS files pass through from ps-launch's own environment (with ``--rank-tokens``, the rank's own
    token instead: :func:`ps_launch.tokens.worker_environment`).

    torchrun's whole environment is set too: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` (every rank of ps-launch runs on this host, so the local ones equal the global
    ones), and ``MASTER_ADDR``/``MASTER_PORT`` (127.0.0.1 and ``args.master_port``, a free port ps-launch
    drew for the job), so ``torch.distributed.init_process_group("gloo")`` forms a process group beside
    grpc-ps for metrics and barriers (gradients still go through the shards)."""
    master = (
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.master_port)} if getattr(args, "master_port", 0) else {}
    )
    return {
        **master,
        "PS_SERVERS": ",".join(addresses),
        "PS_RANK": str(rank),
        "PS_NUM_WORKERS": str(args.workers),
        "RANK": str(rank),
        "WORLD_SIZE": str(args.workers),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(args.workers),
        "PS_STEPS": str(args.steps),
        "PS_BATCH_SIZE": str(args.batch_size),
        "PS_OPTIMIZER": args.optimizer,
        "PS_LR": str(args.lr),
        "PS_MOMENTUM": str(args.momentum),
        "PS_SEED": str(args.seed),
        "PS_TIMEOUT": str(args.timeout),
        "PS_WIRE_DTYPE": args.wire_dtype,
        "PS_TOPK": str(args.topk),
        **tensorboard_environment(args),
    }


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` that was free a moment ago (the job's ``MASTER_PORT``: rank 0's
    ``init_process_group`` binds it, as ``torchrun --standalone`` picks its own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tensorboard_environment(args: Any) -> dict[str, str]:
    """``PS_TENSORBOARD`` and ``PS_TENSORBOARD_EVERY`` of ``ps-launch --tensorboard DIR``; none without it."""
    if not getattr(args, "tensorboard", ""):
        return {}
    path = str(Path(args.tensorboard).resolve())
    return {"PS_TENSORBOARD": path, "PS_TENSORBOARD_EVERY": str(args.tensorboard_every)}


def worker_argv(args: Any, addresses: Sequence[str], rank: int) -> list[str]:
    """``ps-worker``'s command line (after ``python -m``) of rank ``rank`` of a built-in workload."""
    argv = [
        "ps_worker.workloads.cli",
        "--servers",
        ",".join(addresses),
        "--rank",
        str(rank),
        "--num-workers",
        str(args.workers),
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--optimizer",
        args.optimizer,
        "--lr",
        str(args.lr),
        "--momentum",
        str(args.momentum),
        "--seed",
        str(args.seed),
        "--timeout",
        str(args.timeout),
        "--slow-rank",
        str(args.slow_rank),
        "--slow-ms",
        str(args.slow_ms),
        "--wire-dtype",
        args.wire_dtype,
        "--topk",
        str(args.topk),
        *(["--overlap"] if args.overlap else []),
        "--elastic-lr",
        args.elastic_lr,
        "--metrics-port",
        "-1" if args.no_metrics else "0",
        "--events",
        args.workload,
    ]
    if args.corpus:
        argv[-1:-1] = ["--corpus", str(Path(args.corpus).resolve())]
    if tensorboard := tensorboard_environment(args):
        argv[-1:-1] = [
            "--tensorboard",
            tensorboard["PS_TENSORBOARD"],
            "--tensorboard-every",
            tensorboard["PS_TENSORBOARD_EVERY"],
        ]
    if getattr(args, "init_from", ""):
        argv[-1:-1] = ["--init-from", str(Path(args.init_from).resolve())]
    return argv
