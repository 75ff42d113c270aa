"""Table rows a job starts from (a model file's, ``ps_worker.model_file.init_from``), cut into the
InitTables row chunks rank 0 sends each shard (docs/operations.md#start-a-job-from-a-model-file).

Rows are routed as pushes are (``ps_common.tables.shard_of``). A row equal, bitwise, to its
deterministic initial value (``ps_common.tables.initial_rows``) is left out: the shard reads it so
already. Each request carries at most ``budget`` bytes of ids and rows (8 + 4 * dim bytes a row).
Pure torch: no grpc.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from ps_common.tables import TableSpec, initial_rows, shard_of
from ps_proto.v1 import ps_pb2

Seeds = Mapping[str, tuple[torch.Tensor, torch.Tensor]]
"""Table name -> (row ids int64 [n], distinct; rows float32 [n, dim])."""

FRAMING_BYTES = 64 * 1024
"""Bytes of a message kept for everything but ids and rows (as the shard's ``tables.calls``)."""

INITIAL_CHECK_ROWS = 1 << 18
"""Rows compared with their initial values at a time (bounds the memory of the comparison)."""


def changed(spec: TableSpec, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """bool [n]: which rows differ (bitwise) from their initial values."""
    out = torch.empty(ids.numel(), dtype=torch.bool)
    for start in range(0, ids.numel(), INITIAL_CHECK_ROWS):
        part = slice(start, start + INITIAL_CHECK_ROWS)
        initial = initial_rows(spec.name, spec.seed, spec.init_std, ids[part], spec.dim)
        out[part] = (rows[part].view(torch.int32) != initial.view(torch.int32)).any(1)
    return out


def seed_blocks(
    specs: Mapping[str, TableSpec], seeds: Seeds, num_shards: int, budget: int
) -> list[list[list[ps_pb2.RowBlock]]]:
    """The InitTables row chunks of each shard.

    Args:
        specs: the tables in force (their seed and init_std give the initial rows).
        seeds: the rows to import. num_shards: shards the rows are spread over.
        budget: bytes of ids and rows one request may carry (one message less framing).

    Returns:
        Per shard, the ``rows`` of each request (at most one block per table each, in ``seeds``' order).

    Raises:
        KeyError: a table the shards do not hold. ValueError: rows not [n, dim] float32 of n ids.
    """
    out: list[list[list[ps_pb2.RowBlock]]] = [[] for _ in range(num_shards)]
    used = [budget] * num_shards  # bytes of the last request of each shard (full: start a new one)
    for name, (ids, rows) in seeds.items():
        spec = specs[name]
        ids = ids.reshape(-1).to(torch.int64)
        if rows.shape != (ids.numel(), spec.dim) or rows.dtype != torch.float32:
            raise ValueError(f"Rows of table {name!r} must be float32 [{ids.numel()}, {spec.dim}], got {rows.shape}.")
        keep = changed(spec, ids, rows)
        ids, rows = ids[keep], rows[keep]
        owner = shard_of(ids, num_shards)
        per_row = 8 + spec.row_bytes
        for k in range(num_shards):
            mine_ids, mine_rows = ids[owner == k], rows[owner == k]
            start = 0
            while start < mine_ids.numel():
                room = (budget - used[k]) // per_row
                if room <= 0:
                    out[k].append([])
                    used[k] = 0
                    room = max(1, budget // per_row)
                stop = start + room
                out[k][-1].append(
                    ps_pb2.RowBlock(
                        table=name,
                        ids=mine_ids[start:stop].numpy().astype("<i8").tobytes(),
                        dtype=ps_pb2.DTYPE_FLOAT32,
                        data=mine_rows[start:stop].contiguous().numpy().astype("<f4").tobytes(),
                    )
                )
                used[k] += min(room, mine_ids.numel() - start) * per_row
                start = stop
    return out


class SeedHost(Protocol):
    """What :func:`send_seeds` uses of the table client (``ps_worker.tables.client.TableClient``)."""

    specs: dict[str, TableSpec]
    seeds: Seeds
    max_message_bytes: int
    transport: Any

    @property
    def num_shards(self) -> int: ...


def send_seeds(tables: SeedHost, request: ps_pb2.InitTablesRequest, call: Callable[[int, Any], Any]) -> int:
    """Rank 0: send ``tables.seeds`` to every shard, one InitTables ``call(k, request)``
    per chunk (the declaration ``request`` with the chunk's rows), then forget them.

    Returns:
        Rows sent.

    Raises:
        ShardError: a refusal (RESOURCE_EXHAUSTED: beyond a table's limits; INVALID_ARGUMENT: rows
            of another table shape). A shard whose tables have trained already (a restarted
            rank 0: FAILED_PRECONDITION) keeps its rows; the rest of its chunks are not sent.
    """
    per_shard = seed_blocks(tables.specs, tables.seeds, tables.num_shards, tables.max_message_bytes - FRAMING_BYTES)
    tables.seeds = {}

    def send(k: int) -> int:
        sent = 0
        for blocks in per_shard[k]:
            chunk = ps_pb2.InitTablesRequest(rank=request.rank, incarnation=request.incarnation, rows=blocks)
            chunk.tables.extend(request.tables)
            if call(k, chunk) is None:
                return sent
            sent += sum(len(b.ids) // 8 for b in blocks)
        return sent

    return sum(tables.transport.each_shard(send))
