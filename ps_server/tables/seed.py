"""Rows rank 0 seeds at table init (``InitTablesRequest.rows``: a job started from a model file,
docs/operations.md#start-a-job-from-a-model-file, or the table modules' own weights,
docs/tables.md#initial-rows-and-the-state-dict): checked in full, then stored exactly.

Pure state under the shard's lock, as :mod:`ps_server.tables.store`. Seeding is an import, not an
update: each row of a block is stored with the block's float32 values as they are (no optimizer
step, optimizer state initial, admission bypassed), counts toward the table's ``max_rows`` and the
shard's ``--max-table-bytes`` like any stored row (checkpoints and exports then hold it as one),
and is accepted only while the tables have taken no update (table version 0, no row pushed or held
for a round). The same rows again (a retried call) store the same values: nothing changes; a row
seeded before with other values is refused (two model files, or two rank 0s, seeding one job).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ps_common.errors import InvalidRequestError, PreconditionError, TableFullError
from ps_proto.v1 import ps_pb2

if TYPE_CHECKING:
    from ps_server.tables.store import TableStore
    from ps_server.tables.table import Table


def _decode(table: Table, block: ps_pb2.RowBlock) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [n], rows float32 [n, dim]) of one block, every check made.

    Raises:
        InvalidRequestError: ids not 8 bytes each, an id twice, out of range or owned by another
            shard; a dtype other than float32; data not n x dim values; non-finite values.
    """
    name = block.table[:80]
    if len(block.ids) % 8 or block.dtype != ps_pb2.DTYPE_FLOAT32:
        raise InvalidRequestError(f"Seed rows of table {name!r} need int64 ids (8 bytes each) and float32 rows.")
    ids = torch.from_numpy(np.frombuffer(block.ids, dtype="<i8").astype(np.int64))
    if len(block.data) != ids.numel() * table.spec.row_bytes:
        raise InvalidRequestError(
            f"Seed rows of table {name!r}: {ids.numel()} ids need {ids.numel() * table.spec.row_bytes} bytes of "
            f"float32 rows of dim {table.spec.dim}, got {len(block.data)}; the model file is of another table."
        )
    if torch.unique(ids).numel() != ids.numel():
        raise InvalidRequestError(f"Seed rows of table {name!r} name a row twice; send each row once.")
    table.check_ids(ids)  # in range and owned here
    rows = torch.from_numpy(np.frombuffer(block.data, dtype="<f4").astype(np.float32)).reshape(-1, table.spec.dim)
    if not bool(torch.isfinite(rows).all()):
        raise InvalidRequestError(f"Seed rows of table {name!r} hold NaN or infinite values; nothing was stored.")
    return ids, rows


def seed_rows(store: TableStore, blocks: Sequence[ps_pb2.RowBlock]) -> int:
    """Store every row of ``blocks`` (one block per table) exactly, all checked before any is
    written (lock held).

    Returns:
        The rows written (stored now, or stored again with the same values).

    Raises:
        PreconditionError: no tables, or the tables have taken an update (training started: the
            shards' rows win; FAILED_PRECONDITION). InvalidRequestError: an unknown table, a
            table twice, a row seeded before with other values, as :func:`_decode`.
            TableFullError: the rows exceed a table's ``max_rows`` or the shard's byte budget
            (RESOURCE_EXHAUSTED). Nothing changes on any.
    """
    if store.version or store.held or any(t.step for t in store.tables.values()):
        raise PreconditionError(
            f"Shard {store.shard_index}'s tables have taken updates (table version {store.version}); rows are "
            "seeded only before training starts. Start a new job (fresh shards) to import a model file's rows."
        )
    decoded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for b in blocks:
        if b.table in decoded:
            raise InvalidRequestError(f"Seed rows name table {b.table[:80]!r} twice; send one block per table.")
        decoded[b.table] = _decode(store.table(b.table), b)
    for name, (ids, rows) in decoded.items():  # a row seeded before keeps its values: a retry, or refused
        t = store.tables[name]
        slots = t.index.lookup(ids)
        held = slots >= 0
        if bool(held.any()) and not torch.equal(t.values[slots[held]].view(torch.int32), rows[held].view(torch.int32)):
            raise InvalidRequestError(
                f"Seed rows of table {name[:80]!r} give {int(held.sum())} rows seeded before other values; a job "
                "seeds its rows once, from one model file (start a new job to import another)."
            )
    new = {name: int((store.tables[name].index.lookup(ids) < 0).sum()) for name, (ids, _) in decoded.items()}
    for name, count in new.items():
        t = store.tables[name]
        if t.rows + count > t.max_rows:
            raise TableFullError(
                f"Seeding table {name!r} on shard {store.shard_index} would hold {t.rows + count} rows, beyond its "
                f"{t.max_rows} (--max-table-rows or the table's max_bytes); nothing was stored. Raise the limit, "
                "add shards, or declare the table's initializer (a meta-device module: rows stored as pushed)."
            )
    store.check_bytes(new)  # TableFullError: beyond --max-table-bytes
    floors = {name: t.bytes_with(new.get(name, 0)) for name, t in store.tables.items()}
    for name, (ids, rows) in decoded.items():
        t = store.tables[name]
        others = sum(floors.values()) - floors[name]
        t.seed(ids, rows, most=max(0, store.max_bytes - others) // t.bytes_per_row)
        floors[name] = t.num_bytes
    return sum(ids.numel() for ids, _ in decoded.values())
