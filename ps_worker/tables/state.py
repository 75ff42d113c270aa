"""Embedding tables in ``model.state_dict()`` and ``client.state_dict()``, as under DDP (docs/tables.md).

``ps_worker.tables.modules.attach_tables`` removes a table's ``weight`` from its module; :func:`attach_state`
makes the module's ``state_dict()`` put it back: ``model.state_dict()`` gathers each such table's current
rows from the shards (the pull path, :meth:`TableClient.pull`, in windows of :data:`WINDOW_ROWS` rows) as a
float32 ``[num_rows, dim]`` tensor under the module's key (``"emb.weight"``), so
``torch.save(model.state_dict())`` loads back into the plain model with ``load_state_dict`` (strict).
A table beyond :data:`MAX_GATHER_BYTES` is refused with a ValueError naming the export that writes it.
``state_dict(keep_vars=True)`` (which asks for the parameters themselves) leaves the tables out.
Loading a table's rows into the model after ``client.init`` is refused (the shards own them): load them
before ``client.init`` (rank 0 seeds the module's weight) or start from a model file (``--init-from``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from ps_worker.tables.client import TableClient

MAX_GATHER_BYTES = 2 * 1024**3
"""Largest table (``num_rows * dim * 4`` bytes) ``state_dict()`` gathers onto a worker: 2 GiB, where
``ps-admin export`` switches to ``.ids``/``.rows``. Raise it (``ps_worker.tables.state.MAX_GATHER_BYTES
= ...``) to gather larger ones; the worker then holds the whole table once."""

WINDOW_ROWS = 1 << 20
"""Rows pulled per call of a gather (bounds the memory beside the result)."""


def gather(tables: TableClient, table: str, min_version: int | None = None) -> torch.Tensor:
    """Every row of ``table`` as the shards hold it (rows never stored at their initial values).

    Args:
        tables: the worker's tables.
        table: its name (``"emb.weight"``).
        min_version: the table version to read (None: as a forward's pull, in sync mode the round of
            this rank's last push; every window then reads that same version).

    Returns:
        float32 CPU tensor ``[num_rows, dim]``.

    Raises:
        ValueError: the table is larger than :data:`MAX_GATHER_BYTES`. RuntimeError: the client is
            closed. ShardError: a refused pull.
    """
    if tables.closed:
        raise RuntimeError(
            f"Table {table!r} lives on the shards and its client is closed: call model.state_dict() (or "
            "client.state_dict()) before client.close(), or export the job with `ps-admin export`."
        )
    spec = tables.specs[table]
    size = spec.num_rows * spec.row_bytes
    if size > MAX_GATHER_BYTES:
        raise ValueError(
            f"Table {table!r} is {spec.num_rows} x {spec.dim} ({size / 2**30:.1f} GiB), more than state_dict() "
            f"gathers onto a worker ({MAX_GATHER_BYTES / 2**30:.1f} GiB, ps_worker.tables.state.MAX_GATHER_BYTES); "
            "write it with `ps-admin export` or `ps-launch --save` (its held rows as .ids/.rows), or raise the limit."
        )
    floor = tables.pull_floor() if min_version is None else min_version
    out = torch.empty(spec.num_rows, spec.dim, dtype=torch.float32)
    for start in range(0, spec.num_rows, WINDOW_ROWS):
        stop = min(spec.num_rows, start + WINDOW_ROWS)
        out[start:stop] = tables.pull({table: torch.arange(start, stop, dtype=torch.int64)}, floor)[table]
    return out


def table_state(tables: TableClient | None, min_version: int | None = None) -> dict[str, torch.Tensor]:
    """Table name -> :func:`gather` of every table whose module held a weight (what ``client.state_dict()``
    adds to the dense entries); empty without tables.

    Raises:
        ValueError, ShardError: as :func:`gather`.
    """
    if tables is None:
        return {}
    return {name: gather(tables, name, min_version) for name in tables.matrices}


def attach_state(module: nn.Module, tables: TableClient, table: str) -> None:
    """Make ``module.state_dict()`` hold ``table``'s rows under ``prefix + "weight"`` (module docstring),
    and ``module.load_state_dict()`` refuse rows for it."""
    tables.matrices.append(table)
    save, load = module._save_to_state_dict, module._load_from_state_dict
    object.__setattr__(module, "_save_to_state_dict", functools.partial(_save, save, tables, table))
    object.__setattr__(module, "_load_from_state_dict", functools.partial(_load, load, table))


def _save(
    save: Callable[..., None], tables: TableClient, table: str, out: dict[str, Any], prefix: str, keep_vars: bool
) -> None:
    save(out, prefix, keep_vars)
    if not keep_vars:  # keep_vars asks for the module's own tensors: the table is none of them
        out[prefix + "weight"] = gather(tables, table)


def _load(load: Callable[..., None], table: str, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    if prefix + "weight" in state_dict:
        error_msgs = args[-1]  # (local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        error_msgs.append(
            f"{prefix}weight: table {table!r} lives on the shards since client.init and takes no rows from "
            "load_state_dict; load them before client.init (rank 0 seeds the module's weight) or start the job "
            "from a model file (--init-from, ps_worker.model_file.init_from)"
        )
        state_dict = {k: v for k, v in state_dict.items() if k != prefix + "weight"}
    load(state_dict, prefix, *args)
