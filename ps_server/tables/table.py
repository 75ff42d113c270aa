"""The embedding tables one shard holds: rows created on their first update, read lazily, updated
row-wise (docs/tables.md).

Pure state (torch, no grpc, no lock: the shard's condition guards it). A :class:`Table` keeps only
the rows of its table this shard owns (``ps_common.tables.shard_of``) that were updated at least
once, in slots of one growing [capacity, dim] float32 tensor (plus one per optimizer state); a row
never updated reads as ``initial_rows`` (name, seed, id), so a pull allocates nothing. A push that
would create rows beyond ``max_rows`` (or beyond the shard's byte budget: ``TableStore``) is refused
with :class:`TableFullError` (RESOURCE_EXHAUSTED) and changes nothing: refusal, never eviction. The
storage grows in proportion to what a push needs (:meth:`Table.grown_capacity`), and ids map to
slots through a vectorized :class:`~ps_server.tables.row_index.RowIndex` (no per-id Python).

Row gradients are coalesced in a fixed order (:func:`coalesce`: a stable sort by id, then a sum of
each id's rows in the order they came, ranks in rank order), so a sync round is bitwise reproducible
whatever the arrival order.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ps_common.errors import InvalidRequestError, NonFiniteUpdateError, TableFullError
from ps_common.tables import RowOptimizerSpec, TableSpec, initial_rows, shard_of
from ps_server.tables.row_index import INDEX_BYTES_PER_ROW, RowIndex
from ps_server.tables.sparse_optim import initial_state, state_names, update_rows

log = logging.getLogger(__name__)


class Reader(Protocol):
    """A pull reading a table in chunks (``ps_server.tables.row_read.RowRead``), as the table sees it."""

    def preserve(self, table: Table, slots: torch.Tensor, values: torch.Tensor) -> None:
        """``table`` is about to overwrite rows at ``slots`` (int64 [m]) whose values are ``values``
        (float32 [m, dim], a copy): keep those the read must still answer (lock held)."""


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


@dataclass
class Prepared:
    """A computed, unwritten row-optimizer step of one table (:meth:`Table.prepare`)."""

    step: int
    ids: torch.Tensor
    slots: torch.Tensor | None
    held: torch.Tensor | None
    state: dict[str, torch.Tensor]
    rows: torch.Tensor | None


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
    """

    def __init__(self, spec: TableSpec, shard_index: int, num_shards: int, max_rows: int) -> None:
        self.spec = spec
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.max_rows = max_rows
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

    def bytes_with(self, new: int) -> int:
        """Bytes the table needs at least once ``new`` more rows are held (its current capacity if larger)."""
        return max(self.capacity, self.rows + new) * self.bytes_per_row

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
            out[missing] = initial_rows(self.spec.name, self.spec.seed, self.spec.init_std, ids[missing], self.spec.dim)
        self.rows_pulled += ids.numel()
        return out

    def new_rows(self, unique_ids: torch.Tensor) -> int:
        """How many of ``unique_ids`` (distinct) are not held yet."""
        return int((self._lookup(unique_ids) < 0).sum())

    def check_room(self, new: int) -> None:
        """Raise TableFullError when ``new`` more rows exceed ``max_rows``."""
        if self.rows + new > self.max_rows:
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
        self.check_room(int((~held).sum()))
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
        return Prepared(step, ids, slots, held, new_state, new_rows)

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
        self.step = prepared.step

    def read_for_update(self, ids: torch.Tensor, slots: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        out = torch.empty(ids.numel(), self.spec.dim, dtype=torch.float32)
        if bool(held.any()):
            out[held] = self.values[slots[held]]
        if not bool(held.all()):
            out[~held] = initial_rows(self.spec.name, self.spec.seed, self.spec.init_std, ids[~held], self.spec.dim)
        return out

    def _allocate(self, ids: torch.Tensor, slots: torch.Tensor, held: torch.Tensor, most: int | None) -> torch.Tensor:
        """Slots for the rows not held yet (the storage grows by :meth:`grown_capacity`); returns
        every id's slot."""
        need = int((~held).sum())
        if need == 0:
            return slots
        n = self.rows
        if n + need > self.capacity:
            target = self.grown_capacity(n + need, self.max_rows if most is None else most)
            grow = target - self.capacity
            self.values = torch.cat([self.values, torch.empty(grow, self.spec.dim)])
            self.ids = torch.cat([self.ids, torch.empty(grow, dtype=torch.int64)])
            fill = initial_state(self.spec.optimizer, grow, self.spec.dim)
            self.state = {k: torch.cat([v, fill[k]]) for k, v in self.state.items()}
        slots = slots.clone()
        new_ids = ids[~held]
        new_slots = torch.arange(n, n + need, dtype=torch.int64)
        slots[~held] = new_slots
        self.ids[n : n + need] = new_ids
        self.index.add(new_ids, new_slots)
        return slots

    # ----------------------------------------------------------------- checkpoints
    def export(self) -> dict[str, Any]:
        """Plain data for ``torch.load(weights_only=True)``: spec fields, ids [n], values [n, dim], state."""
        n = self.rows
        s = self.spec
        return {
            "spec": {
                "name": s.name,
                "num_rows": s.num_rows,
                "dim": s.dim,
                "seed": s.seed,
                "init_std": s.init_std,
                "optimizer": s.optimizer.name,
                "optimizer_kwargs": dict(s.optimizer.kwargs),
            },
            "ids": self.ids[:n].clone(),
            "values": self.values[:n].clone() if n else torch.empty(0, s.dim),
            "state": {k: v[:n].clone() if n else torch.empty(0, s.dim) for k, v in self.state.items()},
            "step": self.step,
        }

    @staticmethod
    def spec_from_export(saved: dict[str, Any]) -> TableSpec:
        s = saved["spec"]
        opt = RowOptimizerSpec(str(s["optimizer"]), {k: float(v) for k, v in s["optimizer_kwargs"].items()})
        return TableSpec(str(s["name"]), int(s["num_rows"]), int(s["dim"]), opt, int(s["seed"]), float(s["init_std"]))

    def restore(self, saved: dict[str, Any]) -> None:
        """Load :meth:`export` output (the spec must be this table's)."""
        self.ids = saved["ids"].to(torch.int64).clone()
        self.values = saved["values"].clone()
        self.state = {k: v.clone() for k, v in saved["state"].items()}
        self.index = RowIndex.of(self.ids)
        self.step = int(saved["step"])
