"""An embedding table in a checkpoint: plain data for ``torch.load(weights_only=True)`` and back."""

from __future__ import annotations

from typing import Any

import torch

from ps_common.tables import RowOptimizerSpec, TableSpec
from ps_server.tables.row_index import RowIndex
from ps_server.tables.table import LIFETIME_FIELDS, Table


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
    """The validated spec of :func:`export_table` output (checkpoints before admission and expiry: off)."""
    s = saved["spec"]
    opt = RowOptimizerSpec(str(s["optimizer"]), {k: float(v) for k, v in s["optimizer_kwargs"].items()})
    life = {k: type(getattr(TableSpec, k))(s[k]) for k in LIFETIME_FIELDS if k in s}
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
