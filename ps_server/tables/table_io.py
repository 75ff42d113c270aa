"""An embedding table in a checkpoint: plain data for ``torch.load(weights_only=True)`` and back."""

from __future__ import annotations

from typing import Any

import torch

from ps_common.errors import CheckpointError
from ps_common.tables import RowOptimizerSpec, TableSpec
from ps_server.tables.row_index import RowIndex
from ps_server.tables.table import LIFETIME_FIELDS, Table

INIT_FIELDS = ("initializer", "init_low", "init_high")
"""TableSpec fields of the declared initializer (checkpoints before them: normal)."""


def export_table(table: Table) -> dict[str, Any]:
    """Plain data for ``torch.load(weights_only=True)``: spec fields, ids [n], values [n, dim], state."""
    s = table.spec
    slots = table.live().nonzero().squeeze(1)
    return {
        "spec": {
            "name": s.name,
            "num_rows": s.num_rows,
            "dim": s.dim,
            "seed": s.seed,
            "init_std": s.init_std,
            **{k: getattr(s, k) for k in INIT_FIELDS},
            "optimizer": s.optimizer.name,
            "optimizer_kwargs": dict(s.optimizer.kwargs),
            **{k: getattr(s, k) for k in LIFETIME_FIELDS},
        },
        "ids": table.ids[slots].clone(),
        "values": table.values[slots].clone(),
        "state": {k: v[slots].clone() for k, v in table.state.items()},
        "step": table.step,
        "life": table.life.export(slots),
    }


def spec_from_export(saved: dict[str, Any]) -> TableSpec:
    """The validated spec of :func:`export_table` output (checkpoints before admission and expiry: off;
    before the uniform initializer: normal)."""
    s = saved["spec"]
    opt = RowOptimizerSpec(str(s["optimizer"]), {k: float(v) for k, v in s["optimizer_kwargs"].items()})
    life = {k: type(getattr(TableSpec, k))(s[k]) for k in (*LIFETIME_FIELDS, *INIT_FIELDS) if k in s}
    return TableSpec(
        str(s["name"]), int(s["num_rows"]), int(s["dim"]), opt, int(s["seed"]), float(s["init_std"]), **life
    )


def restore_table(table: Table, saved: dict[str, Any]) -> None:
    """Load :func:`export_table` output into ``table`` (its spec must be the saved one)."""
    table.ids = saved["ids"].to(torch.int64).clone()
    table.values = saved["values"].clone()
    table.state = {k: v.clone() for k, v in saved["state"].items()}
    table.index = RowIndex.of(table.ids)
    table.step = int(saved["step"])
    table.used = table.ids.numel()
    table.free = torch.empty(0, dtype=torch.int64)
    table.life.restore(saved.get("life"), table.used, table.step)


def check_restored(tables: dict[str, Table], shard_index: int, max_rows: int, max_bytes: int) -> None:
    """Refuse restored ``tables`` that exceed this shard's bounds: a checkpoint resharded onto fewer
    shards (``ps-admin reshard``), or a shard started with smaller limits than it wrote it with.

    Raises:
        CheckpointError: a table holds more than ``max_rows`` rows (``--max-table-rows``), or all of
            them more than ``max_bytes`` bytes (``--max-table-bytes``); nothing is loaded.
    """
    fix = "start the shard with higher limits, or reshard the checkpoints onto more shards (ps-admin reshard --to)"
    for name, t in tables.items():
        if t.rows > max_rows:
            raise CheckpointError(
                f"Shard {shard_index}'s checkpoint holds {t.rows} rows of table {name!r}, more than "
                f"--max-table-rows={max_rows}; {fix}."
            )
    held = sum(t.num_bytes for t in tables.values())
    if held > max_bytes:
        raise CheckpointError(
            f"Shard {shard_index}'s checkpoint holds {held} bytes of tables (values, optimizer state, ids and "
            f"index), more than --max-table-bytes={max_bytes}; {fix}."
        )
