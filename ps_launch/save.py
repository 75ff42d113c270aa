"""``ps-launch --save PATH``: the finished job's model written to one file before the shards stop.

After every worker finished, and before :meth:`ps_launch.cluster.Cluster.stop`, the shards still hold
the model at its final version: it is exported as ``ps-admin export`` does
(:func:`ps_admin.export.write_model`: dense parameters and embedding tables, safetensors or
``torch.save``), with the admin token of ps-launch's environment. The path and format are checked
before anything starts, so a typo fails at once, not after the training; torch (which the export
needs and the launcher does not otherwise import) is imported on a thread while the job trains
(:func:`warm_up`). The workers have finished, so the shards no longer move: the versions they ended at
are written even where they differ (async pushes of a killed rank that reached some shards only), and
stderr says so.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ps_admin.export import write_model
from ps_admin.model_file import ModelFileError, check_target, default_format, format_of
from ps_common.flags import secret

__all__ = ["ModelFileError", "save_model", "save_target", "warm_up"]


def save_target(args: Any, log_dir: Path) -> tuple[str, str] | None:
    """Where ``--save`` writes and in which format: ``--save PATH`` (format of its suffix), else
    ``LOG_DIR/model.safetensors`` (``model.pt`` without safetensors installed) when ``--log-dir`` is
    given; None: nothing is saved.

    Raises:
        ModelFileError: an unknown suffix, a directory that is missing or not writable,
            safetensors asked for but not installed.
    """
    path = getattr(args, "save", "")
    if not path:
        if not args.log_dir:
            return None
        fmt = default_format()
        path = str(log_dir / f"model.{'safetensors' if fmt == 'safetensors' else 'pt'}")
    fmt = format_of(path)
    check_target(path, fmt)
    return path, fmt


def warm_up() -> threading.Thread:
    """Import torch (and safetensors, when installed) on a thread of its own, while the job trains."""

    def load() -> None:
        for name in ("torch", "safetensors.torch"):
            try:
                importlib.import_module(name)
            except ImportError:
                pass

    thread = threading.Thread(target=load, name="ps-launch-save-imports")
    thread.start()
    return thread


def save_model(target: tuple[str, str], addresses: Sequence[str], within: float = 10.0) -> str:
    """Export the shards' model to ``target`` (:func:`save_target`); returns what was written.

    Raises:
        RuntimeError: the export failed (the reason in a sentence); nothing was written.
    """
    path, fmt = target
    try:
        token = secret(os.environ.get("PS_ADMIN_TOKEN", ""), os.environ.get("PS_ADMIN_TOKEN_FILE", ""), "--admin-token")
        warn = lambda text: print(f"ps-launch: --save: {text}", file=sys.stderr)  # noqa: E731
        line = write_model(addresses, token, path, fmt, within=within, allow_mixed=True, warn=warn)
    except (ModelFileError, ValueError) as exc:
        raise RuntimeError(f"--save {path}: the model was not saved: {exc}") from None
    return line.removeprefix("wrote ")
