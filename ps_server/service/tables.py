"""The embedding-table RPCs of ``ps.v1.ParameterService`` (InitTables, PullRows, PushRows): check the
caller, make the one shard call of the request (``Shard.init_tables``, ``Shard.pull_rows``,
``Shard.push_rows``; what they do: ``ps_server.tables.calls``), encode the answer.

:class:`TableRpcs` is held by :class:`~ps_server.service.parameters.ParameterServicer`, which
hands it these three methods. Every request stamped with a rank its caller's token may not act
as (``--rank-tokens``) is refused first (WRONG_RANK). Every request is bounded before any work:
its ids (8 bytes each) and, for a pull, the rows it asks for must fit in one message of
``--max-message-bytes`` (RESOURCE_EXHAUSTED otherwise); every block is checked (table, ids in
range and owned here, dim, dtype, finite values) before anything is held or applied,
so a refused request changes nothing. InitTables of rank 0 may carry rows to seed (a job started
from a model file: ``ps_server.tables.seed``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
import torch

from ps_common.wire import table_spec_from_proto, table_spec_to_proto
from ps_proto.v1 import ps_pb2
from ps_server.service.rank_tokens import RankTokens, check_caller
from ps_server.service.rpc import deadline, maps_errors
from ps_server.tables.calls import ReadRows
from ps_server.tables.reads import TableReads

if TYPE_CHECKING:
    from ps_server.shard.counters import ShardCounters
    from ps_server.shard.shard import Shard


def rows_answer(request: ps_pb2.PullRowsRequest, version: int, rows: list[torch.Tensor]) -> ps_pb2.PullRowsResponse:
    """The PullRows answer: float32 [n, dim] rows per block of ``request``, at table version ``version``."""
    return ps_pb2.PullRowsResponse(
        version=version,
        blocks=[
            ps_pb2.RowBlock(table=b.table, dtype=ps_pb2.DTYPE_FLOAT32, data=r.numpy().tobytes())
            for b, r in zip(request.blocks, rows, strict=True)
        ],
    )


class TableRpcs:
    """InitTables, PullRows and PushRows of ParameterService (see the module docstring).

    Args:
        shard: the shard served. counters: where refused requests are counted (``rejected_requests``).
        rank_tokens: per-rank credentials (``--rank-tokens``), or None.
        table_reads: where PullRows' reads run (``ps_server.tables.reads``); None: on the calling thread.
    """

    def __init__(
        self, shard: Shard, counters: ShardCounters, rank_tokens: RankTokens | None, table_reads: TableReads | None
    ) -> None:
        self.shard = shard
        self.counters = counters
        self.rank_tokens = rank_tokens
        self.table_reads = table_reads

    @maps_errors
    def InitTables(self, request: ps_pb2.InitTablesRequest, context: grpc.ServicerContext) -> ps_pb2.InitTablesResponse:
        check_caller(context, request.rank, "InitTables", self.rank_tokens)
        specs = [table_spec_from_proto(t) for t in request.tables]
        applied, version, clock, tables = self.shard.init_tables(
            request.rank, request.incarnation, specs, deadline(context), request.rows
        )
        return ps_pb2.InitTablesResponse(
            applied=applied, version=version, clock=clock, tables=[table_spec_to_proto(t) for t in tables]
        )

    @maps_errors
    def PullRows(self, request: ps_pb2.PullRowsRequest, context: grpc.ServicerContext) -> ps_pb2.PullRowsResponse:
        check_caller(context, request.rank, "PullRows", self.rank_tokens)

        def reader(read: ReadRows) -> ps_pb2.PullRowsResponse:
            answer = lambda: rows_answer(request, *read())  # noqa: E731
            return answer() if self.table_reads is None else self.table_reads.run(answer)  # at the lowest CPU priority

        return self.shard.pull_rows(
            request.rank, request.incarnation, request.blocks, request.min_version, deadline(context), reader
        )

    @maps_errors
    def PushRows(self, request: ps_pb2.PushRowsRequest, context: grpc.ServicerContext) -> ps_pb2.PushRowsResponse:
        check_caller(context, request.rank, "PushRows", self.rank_tokens)
        version, duplicate = self.shard.push_rows(
            request.rank,
            request.incarnation,
            request.session,
            request.clock,
            request.blocks,
            dict(request.hyperparameters),
        )
        return ps_pb2.PushRowsResponse(version=version, duplicate=duplicate)
