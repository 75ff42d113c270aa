"""A pull of table rows as of one version, read in bounded chunks so the shard's lock is never held
for a whole large pull (docs/tables.md).

A :class:`RowRequest` is prepared without the lock (ids sorted, owning shards computed: the costly
O(n log n) part). Under the lock, :meth:`RowRead.open` fixes the version and, per table, the rows
held then; each :meth:`RowRead.step` (under the lock) looks up and copies at most
``READ_CHUNK_IDS`` ids and ``READ_CHUNK_BYTES`` of rows; between steps the lock is free and
pushes apply. The answer is still the state at the opening version, exactly:

- a row first created after the opening (its slot is at or beyond the slots used then) reads as
  its initial value, as it did at the opening;
- before a table evicts rows or reuses an evicted row's slot, it finishes every read open on it
  (:meth:`RowRead.finish`: the chunks left are read at once, under the lock), so no read ever
  follows a slot that changed rows;
- a held row that a push overwrites while the read is open keeps the value it had at the opening:
  the table hands every open read the old values of the rows it is about to overwrite
  (:meth:`RowRead.preserve`, called by ``Table.commit`` under the lock), and :meth:`RowRead.result`
  puts the oldest preserved value of a row in place of whatever a later chunk copied (a
  copy-on-write undo log; preserved rows are at most the rows written while the read is open).

:meth:`RowRead.result` (no lock) then computes the initial values of rows never updated
(``ps_common.tables.initial_rows``, batched) and puts the rows back in the order asked. Pure torch:
the caller holds the shard's condition around :meth:`open`, :meth:`step` and :meth:`close`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ps_common.tables import shard_of
from ps_server.tables.table import READ_CHUNK_BYTES, READ_CHUNK_IDS, Table


@dataclass
class RowRequest:
    """One block of a pull, prepared without the lock.

    Attributes:
        table: the table's name.
        ids: int64 [n] as asked (any order, duplicates allowed).
        sorted_ids: int64 [n] ascending.
        order: int64 [n], ``ids[order] == sorted_ids``; None when ``ids`` was sorted already.
        owners: int64 [n], the shard of each of ``sorted_ids``.
    """

    table: str
    ids: torch.Tensor
    sorted_ids: torch.Tensor
    order: torch.Tensor | None
    owners: torch.Tensor

    @classmethod
    def of(cls, table: str, ids: torch.Tensor, num_shards: int) -> RowRequest:
        """Sort ``ids`` (int64 [n]) and compute their owners among ``num_shards`` shards."""
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() < 2 or bool((ids[1:] >= ids[:-1]).all()):
            sorted_ids, order = ids, None
        else:
            sorted_ids, order = torch.sort(ids)
        return cls(table, ids, sorted_ids, order, shard_of(sorted_ids, num_shards))


class _Part:
    """The state of one block of a :class:`RowRead`."""

    def __init__(self, table: Table, request: RowRequest) -> None:
        self.table = table
        self.request = request
        n = request.sorted_ids.numel()
        self.slots = torch.full((n,), -1, dtype=torch.int64)
        self.rows = torch.empty(n, table.spec.dim, dtype=torch.float32)
        self.done = 0
        self.chunk = max(1, min(READ_CHUNK_IDS, READ_CHUNK_BYTES // table.spec.row_bytes))


class RowRead:
    """A consistent read of several blocks (see the module docstring); each table it reads holds it
    among its :attr:`~ps_server.tables.table.Table.readers` (a
    :class:`~ps_server.tables.table.Reader`) until :meth:`close`.

    Args:
        blocks: (table, prepared request) per block; ids checked by the caller.
    """

    def __init__(self, blocks: Sequence[tuple[Table, RowRequest]]) -> None:
        self.parts = [_Part(t, r) for t, r in blocks]
        self.version = -1
        self.steps = 0
        self._tables: list[Table] = []
        self._held_at_open: dict[int, int] = {}  # id(table) -> rows held at the opening
        self._saved: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def open(self, version: int) -> None:
        """Fix the state read: ``version`` and each table's held rows (lock held)."""
        self.version = version
        for part in self.parts:
            t = part.table
            if id(t) not in self._held_at_open:
                self._held_at_open[id(t)] = t.used
                self._saved[id(t)] = []
                self._tables.append(t)
                t.readers.append(self)
            t.rows_pulled += part.request.ids.numel()
            t.bytes_sent += part.request.ids.numel() * t.spec.row_bytes

    @property
    def done(self) -> bool:
        return all(p.done == p.slots.numel() for p in self.parts)

    def step(self) -> bool:
        """Look up and copy the next chunk (lock held): at most ``READ_CHUNK_IDS`` ids and
        ``READ_CHUNK_BYTES`` of rows. Returns True while chunks remain."""
        for part in self.parts:
            n = part.slots.numel()
            if part.done == n:
                continue
            lo, hi = part.done, min(n, part.done + part.chunk)
            slots = part.table.index.lookup(part.request.sorted_ids[lo:hi])
            slots[slots >= self._held_at_open[id(part.table)]] = -1  # created after the opening
            held = slots >= 0
            part.slots[lo:hi] = slots
            if bool(held.any()):
                part.rows[lo:hi][held] = part.table.values[slots[held]]
            part.done = hi
            self.steps += 1
            break
        return not self.done

    def preserve(self, table: Table, slots: torch.Tensor, values: torch.Tensor) -> None:
        """``table`` is about to overwrite rows at ``slots`` (int64 [m]) whose values are ``values``
        (float32 [m, dim], a copy): keep those held at the opening (lock held)."""
        start = self._held_at_open.get(id(table))
        if start is None:
            return
        if self.done:  # every chunk read: later writes are after what it copied
            return
        keep = slots < start
        if bool(keep.any()):
            self._saved[id(table)].append((slots[keep], values[keep]))

    def finish(self) -> None:
        """Read every chunk left now (lock held): the table is about to evict rows or reuse the
        slots of evicted rows (``Table.evict``), which an open read's slots would not follow."""
        while self.step():
            pass

    def close(self) -> None:
        """Stop receiving preserved rows (lock held); call once, after the last :meth:`step`."""
        for t in self._tables:
            t.readers.remove(self)

    def result(self) -> list[torch.Tensor]:
        """The rows of each block, float32 [n, dim] in the order asked, as of :attr:`version`
        (after :meth:`close`; no lock needed)."""
        out = []
        for part in self.parts:
            rows, slots, spec = part.rows, part.slots, part.table.spec
            saved = self._saved[id(part.table)]
            if saved:
                self._restore_preserved(rows, slots, saved)
            missing = slots < 0
            if bool(missing.any()):
                ids = part.request.sorted_ids[missing]
                rows[missing] = spec.initial(ids)
            order = part.request.order
            if order is not None:
                unsorted = torch.empty_like(rows)
                unsorted[order] = rows
                rows = unsorted
            out.append(rows)
        return out

    @staticmethod
    def _restore_preserved(
        rows: torch.Tensor, slots: torch.Tensor, saved: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Put the oldest preserved value of each saved slot into ``rows`` where ``slots`` holds it."""
        all_slots = torch.cat([s for s, _ in saved])
        all_values = torch.cat([v for _, v in saved])
        unique, inverse = torch.unique(all_slots, return_inverse=True)
        positions = torch.arange(all_slots.numel())
        first = torch.full((unique.numel(),), all_slots.numel(), dtype=torch.int64)
        first = first.scatter_reduce(0, inverse, positions, reduce="amin")  # the oldest write of each slot
        oldest = all_values[first]
        held = (slots >= 0).nonzero().squeeze(1)
        if held.numel() == 0:
            return
        mine = slots[held]
        at = torch.searchsorted(unique, mine).clamp_(max=unique.numel() - 1)
        hit = unique[at] == mine
        rows[held[hit]] = oldest[at[hit]]
