"""Table rows a job starts from (a model file's, ``ps_worker.model_file.init_from``, or the table
modules' own weights: ``ps_worker.tables.modules``), cut into the InitTables row chunks rank 0 sends
each shard (docs/tables.md#initial-rows-and-the-state-dict, docs/operations.md#start-a-job-from-a-model-file).

Rows are routed as pushes are (``ps_common.tables.shard_of``). A row equal, bitwise, to its
deterministic initial value (``ps_common.tables.initial_rows``) is left out: the shard reads it so
already. Each request carries at most ``budget`` bytes of ids and rows (8 + 4 * dim bytes a row).
Pure torch: no grpc.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from ps_common.tables import TableSpec, shard_of
from ps_proto.v1 import ps_pb2

Seeds = Mapping[str, tuple[torch.Tensor, torch.Tensor]]
"""Table name -> (row ids int64 [n], distinct; rows float32 [n, dim])."""

INITIAL_CHECK_ROWS = 1 << 18
"""Rows compared with their initial values at a time (bounds the memory of the comparison)."""

WINDOW_ROWS = 1 << 18
"""Rows of a table one shard's chunks are cut from at a time (bounds the memory of the copies)."""


def changed(spec: TableSpec, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """bool [n]: which rows differ (bitwise) from their initial values.

    Each row's first element is compared first (its initial value costs 1/dim of the row's: the
    generator's counters are per element), and only rows equal there are compared in full, so
    rows from a module's own initializer (none equal) cost one column of the generator.
    """
    out = torch.empty(ids.numel(), dtype=torch.bool)
    for start in range(0, ids.numel(), INITIAL_CHECK_ROWS):
        part = slice(start, start + INITIAL_CHECK_ROWS)
        first = spec.initial(ids[part], 1)
        same = (rows[part, :1].view(torch.int32) == first.view(torch.int32)).reshape(-1)
        out[part] = ~same
        if bool(same.any()):
            at = same.nonzero().reshape(-1) + start
            initial = spec.initial(ids[at])
            out[at] = (rows[at].view(torch.int32) != initial.view(torch.int32)).any(1)
    return out


def shard_requests(
    specs: Mapping[str, TableSpec], seeds: Seeds, num_shards: int, k: int, budget: int
) -> Iterator[list[ps_pb2.RowBlock]]:
    """The InitTables row chunks of shard ``k``, one request's ``rows`` at a time.

    The rows are read in windows of :data:`WINDOW_ROWS`, so besides ``seeds`` (a module's weight,
    not copied) a shard's chunks take one window and one request of memory at a time.

    Args:
        specs: the tables in force (their seed and init_std give the initial rows).
        seeds: the rows to import. num_shards: shards the rows are spread over; k: this one.
        budget: bytes of ids and rows one request may carry (one message less framing).

    Yields:
        The ``rows`` of each request: at most one block per table, in ``seeds``' order.

    Raises:
        KeyError: a table the shards do not hold. ValueError: rows not [n, dim] float32 of n ids.
    """
    pending: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    used = 0

    def flush() -> list[ps_pb2.RowBlock]:
        blocks = [
            ps_pb2.RowBlock(
                table=name,
                ids=torch.cat([i for i, _ in parts]).numpy().astype("<i8").tobytes(),
                dtype=ps_pb2.DTYPE_FLOAT32,
                data=torch.cat([r for _, r in parts]).contiguous().numpy().astype("<f4").tobytes(),
            )
            for name, parts in pending.items()
        ]
        pending.clear()
        return blocks

    for name, (all_ids, all_rows) in seeds.items():
        spec = specs[name]
        all_ids = all_ids.reshape(-1)
        if all_rows.shape != (all_ids.numel(), spec.dim) or all_rows.dtype != torch.float32:
            raise ValueError(
                f"Rows of table {name!r} must be float32 [{all_ids.numel()}, {spec.dim}], got {all_rows.shape}."
            )
        per_row = 8 + spec.row_bytes
        for start in range(0, all_ids.numel(), WINDOW_ROWS):
            ids = all_ids[start : start + WINDOW_ROWS].to(torch.int64)
            mine = shard_of(ids, num_shards) == k
            ids, rows = ids[mine], all_rows[start : start + WINDOW_ROWS][mine]
            keep = changed(spec, ids, rows)
            if not bool(keep.all()):  # a module's own weights: none equal, nothing to drop
                ids, rows = ids[keep], rows[keep]
            while ids.numel():
                room = (budget - used) // per_row
                if room <= 0:
                    if pending:
                        yield flush()
                    used = 0
                    room = max(1, budget // per_row)
                pending.setdefault(name, []).append((ids[:room], rows[:room]))
                used += min(room, ids.numel()) * per_row
                ids, rows = ids[room:], rows[room:]
    if pending:
        yield flush()


def seed_blocks(
    specs: Mapping[str, TableSpec], seeds: Seeds, num_shards: int, budget: int
) -> list[list[list[ps_pb2.RowBlock]]]:
    """Every shard's :func:`shard_requests` at once (per shard, the ``rows`` of each request).

    Raises:
        KeyError, ValueError: as :func:`shard_requests`.
    """
    return [list(shard_requests(specs, seeds, num_shards, k, budget)) for k in range(num_shards)]
