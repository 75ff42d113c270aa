"""``Admin/ExportParameters``: one shard's plan, parameters and table rows at one version, for a
model file.

A finished job's model must be recoverable after every worker has exited: ``Pull`` belongs to
joined ranks and carries no shapes, so ``ps-admin export`` asks each shard here instead, with the
admin token. The values come from :meth:`~ps_server.shard.shard.Shard.export_state`, the consistent
snapshot a checkpoint takes (under the shard's lock, so every partition and every table row is of
the same version). Table rows travel after the partitions, in chunks of at most ``partition_bytes``
(and of the shard's ``--max-message-bytes``): only the rows the shard holds (updated at least once);
a row never updated reads as its initial value, which ``ps-admin export`` computes from the table's
spec (docs/tables.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from ps_common import errors
from ps_common.codec import dtype_to_proto
from ps_common.plan import ParameterSpec, plan_for_digest
from ps_common.tables import max_rows_per_message
from ps_common.wire import plan_to_proto, table_spec_to_proto
from ps_proto.v1 import ps_pb2
from ps_server.tables.table_io import spec_from_export

log = logging.getLogger(__name__)


def export_messages(shard: Any) -> Iterator[ps_pb2.ExportParametersResponse]:
    """The ExportParameters stream of ``shard``: a first message with the plan, the buffer keys,
    the shard index and the table specs, then one message per owned partition in plan order, then
    the held rows of each table in chunks (:func:`row_chunks`), all of one version.

    Every message stays within the shard's ``--max-message-bytes``: a partition is at most the
    plan's ``partition_bytes`` (its Init partitions, as large, were accepted under the same limit)
    and the plan message is no larger than the Init header that brought it.

    Args:
        shard: a :class:`~ps_server.shard.shard.Shard` (``shard_index``, ``limits`` and
            ``export_state()`` are used).

    Yields:
        ``ExportParametersResponse`` messages; partitions carry each parameter's own dtype
        (float32, float16, bfloat16 or float64; integer buffers were sent as float64 at Init).

    Raises:
        NotInitializedError: no rank 0 has initialized the shard yet.
    """
    try:
        state = shard.export_state()
    except errors.NotInitializedError:
        raise errors.NotInitializedError(
            f"Shard {shard.shard_index} holds no parameters yet (rank 0 has not initialized it); "
            "export once training has started."
        ) from None
    info = state["plan"]
    specs = [ParameterSpec(key, tuple(shape), dtype) for key, shape, dtype in info["specs"]]
    plan = plan_for_digest(specs, info["num_shards"], info["partition_bytes"], info["digest"])
    version = int(state["version"])
    tables = state.get("tables") or {"version": 0, "tables": []}
    tables_version = int(tables["version"])
    log.info("shard %d: exporting %d partitions at version %d", shard.shard_index, len(state["tensors"]), version)
    yield ps_pb2.ExportParametersResponse(
        version=version,
        plan=plan_to_proto(plan),
        buffers=list(state["optimizer"].get("buffers", [])),
        shard_index=shard.shard_index,
        tables=[table_spec_to_proto(spec_from_export(t)) for t in tables["tables"]],
        tables_version=tables_version,
    )
    for part, tensor in zip(plan.owned_by(shard.shard_index), state["tensors"], strict=True):
        yield ps_pb2.ExportParametersResponse(
            version=version,
            partition=ps_pb2.Partition(
                key=part.key,
                offset=part.offset,
                length=part.length,
                dtype=dtype_to_proto(plan.dtypes[part.key]),
                data=tensor.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes(),  # raw little-endian
            ),
            tables_version=tables_version,
        )
    budget = min(plan.partition_bytes, shard.limits.max_message_bytes)
    for saved in tables["tables"]:
        for block in row_chunks(saved["spec"]["name"], saved["ids"], saved["values"], budget):
            yield ps_pb2.ExportParametersResponse(version=version, tables_version=tables_version, rows=block)


def row_chunks(name: str, ids: torch.Tensor, values: torch.Tensor, budget: int) -> Iterator[ps_pb2.RowBlock]:
    """The rows of table ``name`` as RowBlocks of at most ``budget`` bytes of ids and values each
    (at least one row per block: a row of the largest dim, 256 KiB, fits any message limit).

    Args:
        ids: int64 [n] row ids (slot order).
        values: float32 [n, dim].
    """
    dim = values.shape[1] if values.dim() == 2 else 1
    step = max(1, max_rows_per_message(budget, dim, overhead=1024))
    for start in range(0, ids.numel(), step):
        chunk = slice(start, start + step)
        yield ps_pb2.RowBlock(
            table=name,
            ids=ids[chunk].contiguous().numpy().tobytes(),
            dtype=ps_pb2.DTYPE_FLOAT32,
            data=values[chunk].contiguous().numpy().tobytes(),
        )
