"""The embedding-table RPCs of ``ps.v1.ParameterService`` (InitTables, PullRows, PushRows): decode,
call the shard's :class:`~ps_server.tables.store.TableStore` under the shard's condition, encode.

A mixin of :class:`~ps_server.service.parameters.ParameterServicer` (which supplies ``shard``,
``counters`` and ``rank_tokens``). Every request stamped with a rank its caller's token may not act
as (``--rank-tokens``) is refused first (WRONG_RANK). Every request is bounded before any work:
its ids (8 bytes each) and, for a pull, the rows it asks for must fit in one message of
``--max-message-bytes`` (RESOURCE_EXHAUSTED otherwise); every block is checked (table, ids in
range and owned here, dim, dtype, finite values) before anything is held or applied,
so a refused request changes nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc
import numpy as np
import torch

from ps_common.errors import InvalidRequestError, RequestTooLargeError, VersionAheadError
from ps_common.wire import table_spec_from_proto, table_spec_to_proto
from ps_proto.v1 import ps_pb2
from ps_server.membership.ranks import Membership
from ps_server.service.rank_tokens import RankTokens, check_caller
from ps_server.service.rpc import deadline, maps_errors
from ps_server.tables.reads import TableReads
from ps_server.tables.row_read import RowRead, RowRequest
from ps_server.tables.store import TableStore
from ps_server.tables.table import RowGrads

if TYPE_CHECKING:
    from ps_server.shard.counters import ShardCounters
    from ps_server.shard.shard import Shard

log = logging.getLogger("ps_server.service.parameters")

FRAMING_BYTES = 64 * 1024
"""Bytes of a message kept for everything but ids and rows (names, headers)."""


def decode_ids(raw: bytes, table: str) -> torch.Tensor:
    """int64 [n] of little-endian ``raw``.

    Raises:
        InvalidRequestError: a length that is not a multiple of 8.
    """
    if len(raw) % 8:
        raise InvalidRequestError(
            f"Block of table {table[:80]!r}: ids must be int64, 8 bytes each; got {len(raw)} bytes."
        )
    return torch.from_numpy(np.frombuffer(raw, dtype="<i8").astype(np.int64))


def check_size(blocks: Sequence[ps_pb2.RowBlock], max_message_bytes: int, store: TableStore, pull: bool) -> None:
    """Refuse a request whose ids, or whose answer's rows (a pull), exceed one message.

    Raises:
        RequestTooLargeError: too many ids or rows. InvalidRequestError, PreconditionError: unknown table.
    """
    budget = max_message_bytes - FRAMING_BYTES
    ids = sum(len(b.ids) for b in blocks)
    answer = sum(len(b.ids) // 8 * store.table(b.table).spec.row_bytes for b in blocks) if pull else 0
    if ids > budget or answer > budget:
        raise RequestTooLargeError(
            f"The request carries {ids // 8} row ids ({answer} bytes of rows to answer); one message carries "
            f"{budget} bytes (--max-message-bytes less framing). Split the ids over several requests."
        )


class TableRpcs:
    """InitTables, PullRows and PushRows of ParameterService (see the module docstring)."""

    shard: Shard  # supplied by ParameterServicer
    counters: ShardCounters
    rank_tokens: RankTokens | None
    table_reads: TableReads | None
    """Where PullRows' reads run (``ps_server.tables.reads``); None: on the calling thread."""

    @maps_errors
    def InitTables(self, request: ps_pb2.InitTablesRequest, context: grpc.ServicerContext) -> ps_pb2.InitTablesResponse:
        shard = self.shard
        check_caller(context, request.rank, "InitTables", self.rank_tokens)
        specs = [table_spec_from_proto(t) for t in request.tables]
        remaining = deadline(context)
        with shard._cond:
            member = shard.membership.get(request.rank, request.incarnation)
            if request.rank == 0:  # only the joined, live rank 0 declares (NOT_JOINED otherwise)
                Membership.check_live(member, request.incarnation)
            store: TableStore = shard.tables
            if request.rank != 0 and not store.tables:  # rank 0 declares, the others wait for it
                until = None if remaining is None else shard.now() + remaining
                shard.waits.until(
                    lambda: bool(store.tables),
                    until,
                    lambda: f"Shard {shard.shard_index}: rank 0 did not declare its tables in time; start rank 0.",
                )
            applied = store.declare(specs)
            if applied:
                shard._cond.notify_all()
            return ps_pb2.InitTablesResponse(
                applied=applied,
                version=store.version,
                clock=store.clock_of(shard.mode, request.rank, request.incarnation),
                tables=[table_spec_to_proto(t.spec) for t in store.tables.values()],
            )

    @maps_errors
    def PullRows(self, request: ps_pb2.PullRowsRequest, context: grpc.ServicerContext) -> ps_pb2.PullRowsResponse:
        shard = self.shard
        check_caller(context, request.rank, "PullRows", self.rank_tokens)
        remaining = deadline(context)
        with shard._cond:
            store: TableStore = shard.tables
            shard.membership.get(request.rank, request.incarnation)
            check_size(request.blocks, shard.limits.max_message_bytes, store, pull=True)
            for b in request.blocks:
                store.table(b.table)
            if request.min_version > store.version:
                self._wait_for(request.min_version, remaining)
        if self.table_reads is None:
            return self._read_blocks(request)
        return self.table_reads.run(lambda: self._read_blocks(request))  # at the lowest CPU priority

    def _read_blocks(self, request: ps_pb2.PullRowsRequest) -> ps_pb2.PullRowsResponse:
        """The read of a checked PullRows, at the table version now (at least its ``min_version``):
        ids decoded and sorted before the lock, then read a chunk per lock hold."""
        shard = self.shard
        requests = [RowRequest.of(b.table, decode_ids(b.ids, b.table), shard.num_shards) for b in request.blocks]
        with shard._cond:
            read = shard.tables.open_read(requests)
        rows = self._read_rows(read)
        return ps_pb2.PullRowsResponse(
            version=read.version,
            blocks=[
                ps_pb2.RowBlock(table=b.table, dtype=ps_pb2.DTYPE_FLOAT32, data=r.numpy().tobytes())
                for b, r in zip(request.blocks, rows, strict=True)
            ],
        )

    def _read_rows(self, read: RowRead) -> list[torch.Tensor]:
        """Run an opened read in chunks, holding the shard's lock for one chunk at a time (pushes
        apply between chunks; the answer stays the opening version's: ``ps_server.tables.row_read``)."""
        shard = self.shard
        try:
            more = True
            while more:
                with shard._cond:
                    more = read.step()
                if more:
                    time.sleep(0)  # release the GIL: a call waiting for the lock takes it between chunks
        finally:
            with shard._cond:
                read.close()
        return read.result()

    def _wait_for(self, min_version: int, remaining: float | None) -> None:
        """Wait (lock held) until the table version reaches ``min_version``, closing a sync round
        whose ranks have all pushed (an eviction can complete it).

        Raises:
            VersionAheadError: ``min_version`` beyond the next table version (no wait could end on it).
            WaitTimeoutError, ShuttingDownError: as :meth:`~ps_server.shard.waits.Waits.until`.
        """
        shard = self.shard
        store: TableStore = shard.tables
        if min_version > store.version + 1:  # a wait ends on the next table version at most
            raise VersionAheadError(
                f"A PullRows of table version {min_version} waits for nothing shard {shard.shard_index} can make: "
                f"it holds version {store.version} and makes {store.version + 1} next. Pull at most version "
                f"{store.version + 1} (sync: the round after this rank's last PushRows; other modes: 0)."
            )
        until = None if remaining is None else shard.now() + remaining

        def ready() -> bool:
            if shard.mode == "sync" and store.close_round_if_complete(shard.membership.expected(store.version)):
                shard._cond.notify_all()
            return store.version >= min_version

        def describe() -> str:
            missing = [r for r in shard.membership.expected(store.version) if r not in store.held]
            return (
                f"Shard {shard.shard_index} waited for table round {store.version} until the deadline; ranks "
                f"{missing} have not pushed rows for it. Check those workers, or evict them."
            )

        shard.waits.until(ready, until, describe)

    @maps_errors
    def PushRows(self, request: ps_pb2.PushRowsRequest, context: grpc.ServicerContext) -> ps_pb2.PushRowsResponse:
        shard = self.shard
        check_caller(context, request.rank, "PushRows", self.rank_tokens)
        shard.check_session(request.rank, request.incarnation, request.session, "PushRows")
        ids = [decode_ids(b.ids, b.table) for b in request.blocks]
        with shard._cond:
            store: TableStore = shard.tables
            member = shard.membership.get(request.rank, request.incarnation)
            Membership.check_live(member, request.incarnation)
            check_size(request.blocks, shard.limits.max_message_bytes, store, pull=False)
            blocks: dict[str, RowGrads] = {}
            for b, i in zip(request.blocks, ids, strict=True):
                blocks[b.table] = self._grads(store, b, i, b.table in blocks)
            version, duplicate = store.push(shard.mode, request.rank, request.incarnation, request.clock, blocks)
            if not duplicate:
                for b in request.blocks:
                    store.tables[b.table].bytes_received += len(b.ids) + len(b.data)
                if shard.mode != "sync" or store.close_round_if_complete(shard.membership.expected(store.version)):
                    shard._cond.notify_all()
            shard.membership.touch(member)
        return ps_pb2.PushRowsResponse(version=version, duplicate=duplicate)

    @staticmethod
    def _grads(store: TableStore, block: ps_pb2.RowBlock, ids: torch.Tensor, repeated: bool) -> RowGrads:
        """The row gradients of one block, its length and dtype checked against the table's dim.

        Raises:
            InvalidRequestError: a table twice, a dtype other than float32, data not len(ids) x dim.
        """
        table = store.table(block.table)
        if repeated:
            raise InvalidRequestError(f"PushRows names table {block.table[:80]!r} twice; send one block per table.")
        if block.dtype != ps_pb2.DTYPE_FLOAT32:
            raise InvalidRequestError(f"Row gradients of table {block.table[:80]!r} must be float32 (DTYPE_FLOAT32).")
        expected = ids.numel() * table.spec.row_bytes
        if len(block.data) != expected:
            raise InvalidRequestError(
                f"Block of table {block.table[:80]!r}: {ids.numel()} ids need {expected} bytes of float32 rows of dim "
                f"{table.spec.dim}, got {len(block.data)}; the worker's table has another dim than the shards'."
            )
        grads = torch.from_numpy(np.frombuffer(block.data, dtype="<f4").astype(np.float32)).reshape(-1, table.spec.dim)
        return RowGrads(ids, grads)
