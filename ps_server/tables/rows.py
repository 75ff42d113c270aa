"""Row gradients of one table and how a step's are summed in a fixed order (docs/tables.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class RowGrads:
    """Row gradients of one table: ``ids`` int64 [n] (any order, duplicates allowed) and ``grads``
    float32 [n, dim]."""

    ids: torch.Tensor
    grads: torch.Tensor


def coalesce(parts: Sequence[RowGrads], dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the rows of equal ids in a fixed order: ``parts`` concatenated in the order given (rank
    order), a stable sort by id, then each id's rows added in that order (``index_add_`` over
    sorted indices runs sequentially on CPU).

    Returns:
        (unique ids int64 [u] ascending, summed grads float32 [u, dim]).
    """
    if not parts:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dim, dtype=torch.float32)
    ids = torch.cat([p.ids for p in parts])
    grads = torch.cat([p.grads for p in parts])
    order = torch.sort(ids, stable=True).indices
    ids, grads = ids[order], grads[order]
    unique, inverse = torch.unique_consecutive(ids, return_inverse=True)
    if unique.numel() == ids.numel():
        return unique, grads.clone()
    out = torch.zeros(unique.numel(), dim, dtype=torch.float32)
    out.index_add_(0, inverse, grads)
    return unique, out
