"""The embedding tables one shard holds: rows created on their first update, read lazily, updated
row-wise (docs/tables.md).

Pure state (torch, no grpc, no lock: the shard's condition guards it). A :class:`Table` keeps only
the rows of its table this shard owns (``ps_common.tables.shard_of``) that were updated at least
once, in slots of one growing [capacity, dim] float32 tensor (plus one per optimizer state); a row
never updated reads as ``initial_rows`` (name, seed, id), so a pull allocates nothing. A push that
would create rows beyond ``max_rows`` (or the spec's ``max_bytes``, or the shard's byte budget:
``TableStore``) is refused with :class:`TableFullError` (RESOURCE_EXHAUSTED) and changes nothing,
unless the spec says ``on_full="evict_lru"``: then the least recently pushed rows are evicted to
make room. Admission (``admit_after``) and expiry are the table's
:class:`~ps_server.tables.lifetime.RowLife`'s; an evicted row's slot goes to a free list for the
next new row, and any chunked read open on the table is finished first (:meth:`Table.evict`). The
storage grows in proportion to what a push needs (:meth:`Table.grown_capacity`), and ids map to
slots through a vectorized :class:`~ps_server.tables.row_index.RowIndex` (no per-id Python).

Row gradients are coalesced in a fixed order (:func:`coalesce`: a stable sort by id, then a sum of
each id's rows in the order they came, ranks in rank order), so a sync round is bitwise reproducible
whatever the arrival order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from ps_common.errors import InvalidRequestError, NonFiniteUpdateError, TableFullError
from ps_common.tables import RowOptimizerSpec, TableSpec, shard_of
from ps_server.tables.lifetime import LRU_HEADROOM, RowLife
from ps_server.tables.row_index import INDEX_BYTES_PER_ROW, RowIndex
from ps_server.tables.rows import RowGrads as RowGrads
from ps_server.tables.rows import coalesce as coalesce
from ps_server.tables.sparse_optim import initial_state, state_names, update_rows

log = logging.getLogger(__name__)


class Reader(Protocol):
    """A pull reading a table in chunks (``ps_server.tables.row_read.RowRead``), as the table sees it."""

    def preserve(self, table: Table, slots: torch.Tensor, values: torch.Tensor) -> None:
        """``table`` is about to overwrite rows at ``slots`` (int64 [m]) whose values are ``values``
        (float32 [m, dim], a copy): keep those the read must still answer (lock held)."""

    def finish(self) -> None:
        """Read every chunk left now (lock held): the table is about to move rows between slots."""


LIFETIME_FIELDS = ("admit_after", "expire_after_rounds", "expire_after_seconds", "max_bytes", "on_full")
"""TableSpec fields of admission, expiry and the table's own bound (kept in checkpoints)."""

DEFAULT_MAX_TABLE_ROWS = 50_000_000
"""Default ``--max-table-rows``: rows one shard holds per table (12.8 GB of 64-dim rows plus state)."""

DEFAULT_MAX_TABLE_BYTES = 4 * 1024**3
"""Default ``--max-table-bytes``: bytes all tables of one shard may hold (rows, optimizer state,
ids and index, capacity included): 4 GiB, half the dense ``--max-parameter-bytes`` default (8 GiB
over all shards), so a default shard with both at their limits stays within a 16 GiB machine; a
10M x 64 adagrad table on 2 shards (2.7 GB each) fits. Raise it for bigger tables."""

GROWTH_SLACK_BYTES = 64 * 1024**2
"""Room a table's storage may grow beyond what a push needs when small (the doubling is capped at
this many bytes of rows, or half the capacity once that is larger)."""

READ_CHUNK_IDS = 65536
"""Most ids one step of a chunked pull looks up while holding the shard's lock (``row_read.RowRead``):
about 3 ms against 10M held rows on one core."""

READ_CHUNK_BYTES = 4 * 1024**2
"""Most bytes of rows one step of a chunked pull copies while holding the shard's lock."""


def table_row_bytes(spec: TableSpec) -> int:
    """Bytes one row of a table costs a shard: values and optimizer state (float32), its id (int64)
    and its index entry."""
    return spec.row_bytes * (1 + len(state_names(spec.optimizer))) + 8 + INDEX_BYTES_PER_ROW


@dataclass
class Prepared:
    """A computed, unwritten row-optimizer step of one table (:meth:`Table.prepare`)."""

    step: int
    ids: torch.Tensor
    slots: torch.Tensor | None
    held: torch.Tensor | None
    state: dict[str, torch.Tensor]
    rows: torch.Tensor | None
    pending: torch.Tensor | None = None  # ids pushed but not admitted (their gradients dropped)


class Table:
    """The rows of one table this shard owns, with their row-optimizer state.

    Storage: ``values`` float32 [capacity, dim] (plus one tensor per optimizer state), ``ids``
    int64 [capacity] (the id at each slot), slots filled in the order rows were first updated, and
    a :class:`~ps_server.tables.row_index.RowIndex` from id to slot; no per-id Python anywhere. Capacity
    grows in proportion to what a push needs (:meth:`grown_capacity`), never beyond ``max_rows`` or
    the bytes the caller allows.

    Args:
        spec: the table.
        shard_index, num_shards: this shard; ids it does not own are refused.
        max_rows: most rows this shard holds for the table.
        bound: the shard's byte budget for tables (sizes the admission filter without ``max_bytes``).
        clock: wall-clock seconds, for ``expire_after_seconds``.

    Raises:
        InvalidRequestError: ``spec.max_bytes`` below one row's bytes.
    """

    def __init__(
        self,
        spec: TableSpec,
        shard_index: int,
        num_shards: int,
        max_rows: int,
        bound: int = 4 * 1024**3,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.spec = spec
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.max_rows = max_rows
        if spec.max_bytes:
            self.max_rows = min(max_rows, spec.max_bytes // table_row_bytes(spec))
            if self.max_rows == 0:
                raise InvalidRequestError(
                    f"Table {spec.name!r}: max_bytes={spec.max_bytes} holds no row ({table_row_bytes(spec)} bytes with "
                    "its optimizer state, id and index); nothing was declared. Raise max_bytes or leave it 0."
                )
        self.life = RowLife(spec, spec.max_bytes or bound, clock, num_shards)
        self.used = 0  # slots handed out (rows held + free slots)
        self.free = torch.empty(0, dtype=torch.int64)  # slots of evicted rows, reused first
        self.index = RowIndex()
        self.ids = torch.empty(0, dtype=torch.int64)
        self.values = torch.empty(0, spec.dim, dtype=torch.float32)
        self.state: dict[str, torch.Tensor] = initial_state(spec.optimizer, 0, spec.dim)
        self.step = 0
        self.readers: list[Reader] = []  # pulls reading in chunks (``row_read.RowRead``)
        self.rows_pulled = 0
        self.rows_pushed = 0
        self.bytes_sent = 0  # row values answered to pulls
        self.bytes_received = 0  # ids and gradients of accepted pushes

    @property
    def rows(self) -> int:
        """Rows held (updated at least once)."""
        return len(self.index)

    @property
    def capacity(self) -> int:
        """Rows the storage has room for (held or not)."""
        return self.values.shape[0]

    @property
    def bytes_per_row(self) -> int:
        """Bytes one row of capacity costs: its values and optimizer state (float32), its id and its
        index entry."""
        return table_row_bytes(self.spec)

    @property
    def num_bytes(self) -> int:
        """Bytes of the held rows and their optimizer state (capacity included)."""
        return self.capacity * self.bytes_per_row

    @property
    def evicts_lru(self) -> bool:
        return self.spec.on_full == "evict_lru"

    def bytes_with(self, new: int) -> int:
        """Bytes the table needs at least once ``new`` more rows are held (its current capacity if
        larger; an LRU table evicts rather than grow beyond ``max_rows``)."""
        rows = self.rows + new
        if self.evicts_lru:
            rows = min(rows, self.max_rows)
        return max(self.capacity, rows) * self.bytes_per_row

    def check_ids(self, ids: torch.Tensor, owners: torch.Tensor | None = None) -> None:
        """Raise InvalidRequestError unless every id is in ``[0, num_rows)`` and owned here.

        Args:
            owners: ``shard_of(ids, num_shards)`` when already computed (outside the lock).
        """
        if ids.numel() == 0:
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.spec.num_rows:
            bad = low if low < 0 else high
            raise InvalidRequestError(
                f"Row id {bad} is out of table {self.spec.name!r}'s range [0, {self.spec.num_rows}); "
                "send ids in range (hash larger ids into the table's id space first)."
            )
        owner = shard_of(ids, self.num_shards) if owners is None else owners
        if bool((owner != self.shard_index).any()):
            bad = int(ids[owner != self.shard_index][0])
            home = int(shard_of(torch.tensor([bad]), self.num_shards))
            raise InvalidRequestError(
                f"Row {bad} of table {self.spec.name!r} belongs to shard {home}, not {self.shard_index}; "
                "partition ids with ps_common.tables.shard_of."
            )

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id, -1 where the row is not held (int64 [n])."""
        return self.index.lookup(ids)

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Values of rows ``ids`` (int64 [n], checked): held rows, else their initial values.
        Returns float32 [n, dim] (a fresh tensor)."""
        slots = self._lookup(ids)
        held = slots >= 0
        out = torch.empty(ids.numel(), self.spec.dim, dtype=torch.float32)
        if bool(held.any()):
            out[held] = self.values[slots[held]]
        if not bool(held.all()):
            missing = ~held
            out[missing] = self.spec.initial(ids[missing])
        self.rows_pulled += ids.numel()
        return out

    def new_rows(self, unique_ids: torch.Tensor) -> int:
        """How many of ``unique_ids`` (distinct) are not held yet and would be admitted now."""
        fresh = unique_ids[self._lookup(unique_ids) < 0]
        return int(self.life.admit(fresh).sum())

    def check_room(self, new: int, held: int = 0) -> None:
        """Raise TableFullError when ``new`` more rows exceed ``max_rows`` (an LRU table: when
        ``new`` and the ``held`` rows the same step updates exceed it)."""
        if (held + new if self.evicts_lru else self.rows + new) > self.max_rows:
            raise TableFullError(
                f"Table {self.spec.name!r} holds {self.rows} rows on shard {self.shard_index} and this update "
                f"would add {new}, beyond --max-table-rows={self.max_rows}; nothing changed. Raise "
                "--max-table-rows, add shards, or shrink the table's id space."
            )

    def grown_capacity(self, needed: int, most: int) -> int:
        """The capacity to grow to when ``needed`` rows must fit: in proportion to what is asked and
        held, ``max(needed, min(2 * capacity, needed + slack))`` with ``slack`` the larger of
        :data:`GROWTH_SLACK_BYTES` of rows and half the capacity (amortized O(1) copying per row),
        then capped at ``max_rows`` and ``most`` rows (the caller's byte budget), never below ``needed``."""
        slack = max(GROWTH_SLACK_BYTES // self.bytes_per_row, self.capacity // 2)
        if self.evicts_lru or self.spec.expires:  # rows come and go: grow by an eighth, not a half
            slack = max(1024, self.capacity // 8)
        target = max(needed, min(2 * self.capacity, needed + slack))
        return max(needed, min(target, self.max_rows, most))

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, lr: float | None = None) -> None:
        """One row-optimizer step: :meth:`commit` of :meth:`prepare` (all or nothing)."""
        self.commit(self.prepare(ids, grads, lr))

    def optimizer_with(self, overrides: Mapping[str, float] | None) -> RowOptimizerSpec:
        """The table's row optimizer with ``overrides`` (values a push set) in place of its own.

        Raises:
            InvalidRequestError: an override out of the optimizer's range.
        """
        opt = self.spec.optimizer
        return RowOptimizerSpec(opt.name, {**opt.kwargs, **overrides}) if overrides else opt

    def prepare(
        self,
        ids: torch.Tensor,
        grads: torch.Tensor | None,
        lr: float | None = None,
        overrides: Mapping[str, float] | None = None,
    ) -> Prepared:
        """Compute one row-optimizer step with coalesced gradients ``grads`` [u, dim] of distinct
        ``ids`` [u], changing nothing (the table's step counts it even when ``ids`` is empty, as
        torch counts a step of a parameter whose gradient touched no row). ``overrides``: values
        in force in place of the row optimizer's own (:meth:`optimizer_with`).

        Raises:
            TableFullError: new rows beyond ``max_rows``.
            NonFiniteUpdateError: the step would make a row or its state non-finite.
        """
        step = self.step + 1
        if ids.numel() == 0 or grads is None:
            return Prepared(step, ids, None, None, {}, None)
        slots = self._lookup(ids)
        held = slots >= 0
        pending = None
        if self.spec.admits and not bool(held.all()):  # ids below admit_after pushes: dropped, counted
            admit = held.clone()
            admit[~held] = self.life.admit(ids[~held])
            pending = ids[~admit]
            ids, grads, slots, held = ids[admit], grads[admit], slots[admit], held[admit]
        self.check_room(int((~held).sum()), int(held.sum()))
        rows = self.read_for_update(ids, slots, held)
        fresh = initial_state(self.spec.optimizer, ids.numel(), self.spec.dim)
        state = {}
        for name in state_names(self.spec.optimizer):
            s = fresh[name]
            if bool(held.any()):
                s[held] = self.state[name][slots[held]]
            state[name] = s
        new_rows, new_state = update_rows(self.optimizer_with(overrides), rows, grads, state, step, lr)
        if not bool(torch.isfinite(new_rows).all()) or not all(
            bool(torch.isfinite(t).all()) for t in new_state.values()
        ):
            raise NonFiniteUpdateError(
                f"A step of table {self.spec.name!r} would make rows non-finite; nothing changed. Lower the "
                "learning rate or clip gradients."
            )
        return Prepared(step, ids, slots, held, new_state, new_rows, pending)

    def commit(self, prepared: Prepared, most: int | None = None) -> None:
        """Write a :meth:`prepare` result (cannot fail but for memory).

        Args:
            most: the capacity the caller's byte budget allows (rows); None: ``max_rows``.
        """
        if prepared.rows is not None:
            assert prepared.slots is not None and prepared.held is not None
            if self.readers and bool(prepared.held.any()):  # chunked pulls keep the values they started with
                old = prepared.slots[prepared.held]
                values = self.values[old]
                for r in self.readers:
                    r.preserve(self, old, values)
            slots = self._allocate(prepared.ids, prepared.slots, prepared.held, most)
            self.values[slots] = prepared.rows
            for name, value in prepared.state.items():
                self.state[name][slots] = value
            self.rows_pushed += prepared.ids.numel()
            self.life.touch(slots, prepared.step)
            self.life.count(
                prepared.pending if prepared.pending is not None else prepared.ids[:0], int((~prepared.held).sum())
            )
        elif prepared.pending is not None:
            self.life.count(prepared.pending, 0)
        self.step = prepared.step
        self.life.rotate_if_due(self.step)

    def seed(self, ids: torch.Tensor, rows: torch.Tensor, most: int | None = None) -> None:
        """Store rows ``ids`` (int64 [n], distinct, checked, room checked) with exactly ``rows``
        (float32 [n, dim]): admitted, optimizer state initial, step unchanged (``tables.seed``).
        ``most``: as :meth:`commit`."""
        for r in list(self.readers):  # an open chunked read answers what it started with
            r.finish()
        slots = self._lookup(ids)
        slots = self._allocate(ids, slots, slots >= 0, most)
        self.values[slots] = rows
        self.life.touch(slots, self.step)

    def read_for_update(self, ids: torch.Tensor, slots: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        out = torch.empty(ids.numel(), self.spec.dim, dtype=torch.float32)
        if bool(held.any()):
            out[held] = self.values[slots[held]]
        if not bool(held.all()):
            out[~held] = self.spec.initial(ids[~held])
        return out

    def _allocate(self, ids: torch.Tensor, slots: torch.Tensor, held: torch.Tensor, most: int | None) -> torch.Tensor:
        """Slots for the rows not held yet (the storage grows by :meth:`grown_capacity`); returns
        every id's slot."""
        need = int((~held).sum())
        if need == 0:
            return slots
        if self.evicts_lru and self.rows + need > self.max_rows:  # make room: least recently pushed first
            extra = max(0, min(self.max_rows // LRU_HEADROOM, self.max_rows - need - int(held.sum())))
            victims = self.life.least_recent(self.live(), slots[held], self.rows + need - self.max_rows + extra)
            self.evict(victims, "lru")
        if self.free.numel() and self.readers:  # a free slot may be one an open read saw held
            for r in list(self.readers):
                r.finish()
        reuse = self.free[:need]
        self.free = self.free[reuse.numel() :]
        n, fresh = self.used, need - reuse.numel()
        if n + fresh > self.capacity:
            target = self.grown_capacity(n + fresh, self.max_rows if most is None else most)
            grow = target - self.capacity
            self.values = torch.cat([self.values, torch.empty(grow, self.spec.dim)])
            self.ids = torch.cat([self.ids, torch.full((grow,), -1, dtype=torch.int64)])
            fill = initial_state(self.spec.optimizer, grow, self.spec.dim)
            self.state = {k: torch.cat([v, fill[k]]) for k, v in self.state.items()}
            self.life.grow(grow)
        slots = slots.clone()
        new_ids = ids[~held]
        new_slots = torch.cat([reuse, torch.arange(n, n + fresh, dtype=torch.int64)])
        self.used += fresh
        slots[~held] = new_slots
        self.ids[new_slots] = new_ids
        self.index.add(new_ids, new_slots)
        return slots

    def live(self) -> torch.Tensor:
        """bool [used]: which slots hold a row."""
        return self.ids[: self.used] >= 0

    def evict(self, slots: torch.Tensor, reason: str) -> int:
        """Drop the rows at ``slots`` (int64 [m], held) and their optimizer state; they read as their
        initial values again. Chunked reads open on the table are finished first (lock held).
        ``reason``: "expired" or "lru". Returns m."""
        if slots.numel() == 0:
            return 0
        for r in list(self.readers):
            r.finish()
        self.index.remove(self.ids[slots])
        self.ids[slots] = -1
        fill = initial_state(self.spec.optimizer, slots.numel(), self.spec.dim)
        for name, value in fill.items():
            self.state[name][slots] = value
        self.free = torch.cat([self.free, slots])
        self.life.evicted[reason] += slots.numel()
        return slots.numel()

    def expire(self, limit: int | None) -> int:
        """Evict the expired rows among the next ``limit`` slots (None: all). Returns how many."""
        self.life.rotate_if_due(self.step)
        return self.evict(self.life.expired(self.live(), self.step, limit), "expired")
