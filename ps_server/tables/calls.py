"""The embedding-table calls of a shard (InitTables, PullRows, PushRows) against its tables and
membership: what each does while the shard's lock is held.

The shard's facade calls one method of :class:`TableCalls` per request (``Shard.init_tables``,
``Shard.pull_rows``, ``Shard.push_rows``); every method whose docstring says "lock held" assumes
the caller holds it. The table's consistency comes from the shard's policy (``host.policy``:
:class:`~ps_server.policy.base.ConsistencyPolicy`), asked through
:class:`~ps_server.tables.store.TableStore`. Every request is bounded before any work: its ids (8
bytes each) and, for a pull, the rows it asks for must fit in one message of
``--max-message-bytes``; every block is checked (table, ids in range and owned here, dim, dtype,
finite values) before anything is held or applied, so a refused request changes nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from ps_common.errors import InvalidRequestError, RequestTooLargeError, VersionAheadError
from ps_common.tables import TableSpec
from ps_proto.v1 import ps_pb2
from ps_server.membership.ranks import Membership
from ps_server.policy.types import Awaited
from ps_server.tables.metrics import TableRow, table_rows
from ps_server.tables.row_read import RowRead, RowRequest
from ps_server.tables.seed import seed_rows
from ps_server.tables.store import TableStore
from ps_server.tables.table import RowGrads

if TYPE_CHECKING:
    from ps_server.core.limits import Limits
    from ps_server.policy.base import ConsistencyPolicy
    from ps_server.shard.waits import Waits

FRAMING_BYTES = 64 * 1024
"""Bytes of a message kept for everything but ids and rows (names, headers)."""

Rows = tuple[int, list[torch.Tensor]]
"""A pull's answer: (table version read, float32 [n, dim] per block)."""


class TableHost(Protocol):
    """What the table calls use of their shard (``ps_server.shard.shard.Shard``)."""

    shard_index: int
    num_shards: int
    tables: TableStore

    @property
    def membership(self) -> Membership: ...

    waits: Waits
    limits: Limits

    @property
    def policy(self) -> ConsistencyPolicy: ...

    def now(self) -> float:
        """Monotonic seconds."""

    def notify(self) -> None:
        """Wake every wait on the shard's lock (lock held)."""

    def check_session(self, rank: int, incarnation: int, session: int, what: str) -> None:
        """Raise unless ``rank`` is live in ``session`` (takes the shard's lock itself)."""


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


def grads_of(store: TableStore, block: ps_pb2.RowBlock, ids: torch.Tensor, repeated: bool) -> RowGrads:
    """The row gradients of one block, its length and dtype checked against the table's dim.

    Raises:
        InvalidRequestError: a table twice, a dtype other than float32, data not len(ids) x dim.
        PreconditionError: no tables.
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


def read_rows(
    lock: AbstractContextManager[object], store: TableStore, blocks: Sequence[ps_pb2.RowBlock], num_shards: int
) -> Rows:
    """The read of a checked PullRows at the table version now: ids decoded and sorted before the
    lock, then read a chunk per hold of ``lock`` (the shard's; not held by the caller). Pushes apply
    between chunks; the answer stays the opening version's (``ps_server.tables.row_read``).

    Raises:
        InvalidRequestError: ids not a multiple of 8 bytes; as :meth:`TableStore.open_read`.
    """
    requests = [RowRequest.of(b.table, decode_ids(b.ids, b.table), num_shards) for b in blocks]
    with lock:
        read: RowRead = store.open_read(requests)
    try:
        more = True
        while more:
            with lock:
                more = read.step()
            if more:
                time.sleep(0)  # release the GIL: a call waiting for the lock takes it between chunks
    finally:
        with lock:
            read.close()
    return read.version, read.result()


def decode_push(blocks: Iterable[ps_pb2.RowBlock]) -> list[torch.Tensor]:
    """Every block's ids (int64 [n]), decoded before the lock is taken.

    Raises:
        InvalidRequestError: ids not a multiple of 8 bytes.
    """
    return [decode_ids(b.ids, b.table) for b in blocks]


ReadRows = Callable[[], Rows]
"""A PullRows' read, run where and when the caller says (``Shard.pull_rows``)."""


class TableCalls:
    """InitTables, PullRows and PushRows of one shard, against its tables and membership; its facade
    (``ps_server.shard.shard.Shard``) calls them. :meth:`init_tables` assumes the caller holds the
    shard's lock ``cond``; :meth:`pull_rows` and :meth:`push_rows` take it in phases, leaving out the
    work that needs no lock (decoding ids, a read's chunks between holds).

    Args:
        host: the shard, as :class:`TableHost` says.
        cond: the shard's condition (its lock).
    """

    def __init__(self, host: TableHost, cond: threading.Condition) -> None:
        self._host, self._cond = host, cond

    def init_tables(
        self,
        rank: int,
        incarnation: int,
        specs: Sequence[TableSpec],
        remaining: float | None,
        rows: Sequence[ps_pb2.RowBlock] = (),
    ) -> tuple[bool, int, int, list[TableSpec]]:
        """InitTables (takes the lock): rank 0 (joined and live) declares the tables and stores the
        ``rows`` it seeds (``ps_server.tables.seed``); another rank waits for rank 0's declaration,
        then checks its own against it.

        Args:
            remaining: seconds the call may wait (None: no deadline).
            rows: seed rows, one block per table, rank 0 only; a refused seed leaves the tables as
                they were (undeclared when this call declared them).

        Returns:
            (applied: declared now, the table version, the clock the rank's next PushRows carries,
            the tables in force).

        Raises:
            PreconditionError: the mode serves no tables (``policy.check_rows``: easgd, diloco), before
                anything is declared. NotJoinedError, SupersededError: rank 0 not live under ``incarnation``. As
            :meth:`TableStore.declare`; WaitTimeoutError, ShuttingDownError: rank 0 did not declare in time.
            InvalidRequestError: ``rows`` from a rank other than 0. RequestTooLargeError, and as
            :func:`~ps_server.tables.seed.seed_rows`: refused seed rows.
        """
        with self._cond:
            host = self._host
            host.policy.check_rows()
            if rows and rank != 0:
                raise InvalidRequestError(
                    f"Only rank 0 seeds table rows; rank {rank} sent some. Send them from rank 0."
                )
            member = host.membership.get(rank, incarnation)
            if rank == 0:  # only the joined, live rank 0 declares (NOT_JOINED otherwise)
                Membership.check_live(member, incarnation)
            store = host.tables
            if rank != 0 and not store.tables:  # rank 0 declares, the others wait for it
                until = None if remaining is None else host.now() + remaining
                host.waits.until(
                    lambda: bool(store.tables),
                    until,
                    lambda: f"Shard {host.shard_index}: rank 0 did not declare its tables in time; start rank 0.",
                )
            applied = store.declare(specs)
            if rows:
                try:
                    check_size(rows, host.limits.max_message_bytes, store, pull=False)
                    seed_rows(store, rows)
                except Exception:
                    if applied:  # refused: nothing changed, not even the declaration
                        store.tables = {}
                    raise
            if applied:
                host.notify()
            clock = store.clock_of(host.policy, rank, incarnation)
            return applied, store.version, clock, [t.spec for t in store.tables.values()]

    def pull_rows(
        self,
        rank: int,
        incarnation: int,
        blocks: Sequence[ps_pb2.RowBlock],
        min_version: int,
        remaining: float | None,
        reader: Callable[[ReadRows], Any],
    ) -> Any:
        """PullRows: check and wait under the lock (:meth:`check_pull`), then, without it, hand the
        read (:func:`read_rows`, a chunk per hold of the lock) to ``reader``; returns its result."""
        with self._cond:
            self.check_pull(rank, incarnation, blocks, min_version, remaining)
        return reader(lambda: read_rows(self._cond, self._host.tables, blocks, self._host.num_shards))

    def check_pull(
        self, rank: int, incarnation: int, blocks: Sequence[ps_pb2.RowBlock], min_version: int, remaining: float | None
    ) -> None:
        """A PullRows' checks, then its wait for table version ``min_version`` (lock held).

        Raises:
            InvalidRequestError, SupersededError: a bad rank or incarnation. RequestTooLargeError: as
            :func:`check_size`. InvalidRequestError, PreconditionError: an unknown table.
            As :meth:`wait_for_version`.
        """
        host = self._host
        store = host.tables
        host.membership.get(rank, incarnation)
        check_size(blocks, host.limits.max_message_bytes, store, pull=True)
        for b in blocks:
            store.table(b.table)
        if min_version > store.version:
            self.wait_for_version(min_version, remaining)

    def wait_for_version(self, min_version: int, remaining: float | None) -> None:
        """Wait (lock held) until the table version reaches ``min_version``, closing a table round
        whose ranks have all pushed (an eviction can complete it; ``TableStore.advance``).

        Raises:
            VersionAheadError: ``min_version`` beyond the next table version (no wait could end on it).
            AwaitingRanksError: the call's deadline came while ranks that have not pushed rows
                for the round are alive (the worker calls again).
            WaitTimeoutError, ShuttingDownError: as :meth:`~ps_server.shard.waits.Waits.until`.
        """
        host = self._host
        store = host.tables
        if min_version > store.version + 1:  # a wait ends on the next table version at most
            raise VersionAheadError(
                f"A PullRows of table version {min_version} waits for nothing shard {host.shard_index} can make: "
                f"it holds version {store.version} and makes {store.version + 1} next. Pull at most version "
                f"{store.version + 1} (sync: the round after this rank's last PushRows; other modes: 0)."
            )
        until = None if remaining is None else host.now() + remaining

        def ready() -> bool:
            if store.advance(host.policy, host.membership.expected):
                host.notify()
            return store.version >= min_version

        def describe() -> str:
            missing = store.waiting_for(host.membership.expected(store.version))
            return (
                f"Shard {host.shard_index} waited for table round {store.version} until the deadline; ranks "
                f"{missing} have not pushed rows for it. Check those workers, or evict them."
            )

        def awaited() -> Awaited:
            ranks = store.waiting_for(host.membership.expected(store.version))
            return Awaited(f"table round {store.version}", ranks, "pushed rows")

        host.waits.until_awaited(ready, until, describe, host.membership, awaited)

    def push_rows(
        self,
        rank: int,
        incarnation: int,
        session: int,
        clock: int,
        blocks: Sequence[ps_pb2.RowBlock],
        hyper: Mapping[str, float] | None = None,
    ) -> tuple[int, bool]:
        """PushRows: ``rank``'s session checked (``host.check_session``, which takes the lock) and
        the ids decoded (:func:`decode_push`) before the lock, then :meth:`apply_push` under it.
        Returns (version, duplicate); raises as those do."""
        self._host.check_session(rank, incarnation, session, "PushRows")
        ids = decode_push(blocks)
        with self._cond:
            return self.apply_push(rank, incarnation, clock, blocks, ids, hyper)

    def apply_push(
        self,
        rank: int,
        incarnation: int,
        clock: int,
        blocks: Sequence[ps_pb2.RowBlock],
        ids: Sequence[torch.Tensor],
        hyper: Mapping[str, float] | None = None,
    ) -> tuple[int, bool]:
        """PushRows (lock held): check the rank and every block, then hold or apply the push as the
        shard's policy says (:meth:`TableStore.push`), close a complete table round, wake the waits
        when the table version moved.

        Args:
            ids: :func:`decode_push` of ``blocks``.
            hyper: the row optimizer's values for this step and after (:meth:`TableStore.push`).

        Returns:
            (version, duplicate) as :meth:`TableStore.push`.

        Raises:
            NotJoinedError, SupersededError, InvalidRequestError: not live under ``incarnation``.
            RequestTooLargeError, InvalidRequestError, PreconditionError, TableFullError,
            FutureRoundError, UpdateRefusedError: as :func:`check_size`, :func:`grads_of`, :meth:`TableStore.push`.
            ShuttingDownError: the shard is closing.
        """
        host = self._host
        store, policy = host.tables, host.policy
        member = host.membership.get(rank, incarnation)
        Membership.check_live(member, incarnation)
        host.waits.check_open()  # ShuttingDownError: nothing is applied after the final checkpoint
        check_size(blocks, host.limits.max_message_bytes, store, pull=False)
        grads: dict[str, RowGrads] = {}
        for b, i in zip(blocks, ids, strict=True):
            grads[b.table] = grads_of(store, b, i, b.table in grads)
        before = store.version
        version, duplicate = store.push(policy, rank, incarnation, clock, grads, hyper or {})
        if not duplicate:
            for b in blocks:
                store.tables[b.table].bytes_received += len(b.ids) + len(b.data)
            store.advance(policy, host.membership.expected)
            if store.version != before:
                host.notify()
        host.membership.touch(member)
        return version, duplicate

    def metrics(self) -> tuple[list[TableRow], int]:
        """:func:`~ps_server.tables.metrics.table_rows` under the lock (``TableCollector`` reads it)."""
        with self._cond:
            return table_rows(self._host.tables)
