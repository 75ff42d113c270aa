"""All embedding tables of one shard, their version, and how a row push is applied.

Pure state, guarded by the shard's condition (the caller holds it). The shard's consistency policy
(:class:`~ps_server.policy.base.ConsistencyPolicy`, passed per call as the dense pushes ask it)
decides what a row push does (docs/architecture.md#5-consistency):

- **row rounds** (``policy.row_rounds``: sync): a push with clock ``t`` joins table round ``t``
  (= :attr:`TableStore.version`). When every expected rank (the shard's membership, as the dense
  round) has pushed, the round's row gradients are concatenated **in rank order**, coalesced in a
  fixed order (``tables.coalesce``), divided by the number of pushes, and each table takes one
  row-optimizer step; the version becomes ``t + 1``. A pull with ``min_version = t + 1`` waits for
  it. Bitwise reproducible; equal (up to float rounding) to one process stepping torch's sparse
  optimizer on the whole batch.
- **otherwise** (async, ssp): each push is one step at once (its rows summed in the fixed order);
  version + 1. An ssp read does not wait for table clocks (the dense PushPull of the same step
  bounds the gap).
- ``policy.check_rows()`` refuses tables where the mode serves none (easgd: FAILED_PRECONDITION,
  elastic averaging of a table would move every row).

Every push carries (rank, incarnation, clock) and applies at most once: in a row round by the
round, otherwise by a per-rank high-water mark; a repeat is answered ``duplicate`` and changes
nothing. ``policy.row_clock`` says which clock a rank's next push carries.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ps_common.errors import (
    FutureRoundError,
    InvalidRequestError,
    PlanMismatchError,
    PreconditionError,
    TableFullError,
    UpdateRefusedError,
)
from ps_common.tables import MAX_TABLES, ROW_HYPERPARAMETERS, TableSpec
from ps_server.policy import ConsistencyPolicy
from ps_server.tables.lifetime import EXPIRE_SCAN_ROWS
from ps_server.tables.row_read import RowRead, RowRequest
from ps_server.tables.sparse_optim import state_names
from ps_server.tables.table import DEFAULT_MAX_TABLE_BYTES, RowGrads, Table, coalesce, table_row_bytes
from ps_server.tables.table_io import check_restored, export_table, restore_table, spec_from_export

log = logging.getLogger(__name__)


class TableStore:
    """The tables of shard ``shard_index`` of ``num_shards``.

    Args:
        max_rows: most rows one table holds on this shard (``--max-table-rows``).
        max_bytes: most bytes all tables of this shard hold together, capacity and optimizer state
            included (``--max-table-bytes``; ``tables.table_row_bytes`` per row); checked before
            anything is allocated.
        clock: wall-clock seconds, for tables' ``expire_after_seconds``.
    """

    def __init__(  # noqa: PLR0913
        self, shard_index: int, num_shards: int, max_rows: int, max_bytes: int = DEFAULT_MAX_TABLE_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self.clock, self.shard_index, self.num_shards = clock, shard_index, num_shards
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.tables: dict[str, Table] = {}
        self.version = 0
        self.held: dict[int, dict[str, RowGrads]] = {}  # row rounds: the open round's pushes by rank
        self.held_keys: dict[int, int] = {}  # rank -> incarnation of its held push
        self.high_water: dict[int, tuple[int, int]] = {}  # immediate rows: rank -> (incarnation, last clock)
        self.held_hyper: dict[str, float] | None = None  # row rounds: the open round's hyperparameters
        self.hyper: dict[str, float] = {}  # row optimizer values pushes set; in force until changed
        self.refused = 0

    # ----------------------------------------------------------------- declare
    def declare(self, specs: Sequence[TableSpec]) -> bool:
        """Declare the model's tables (rank 0): the first call creates them; later calls (any rank)
        must match them in name, num_rows and dim, and the tables in force stay (their seed,
        initializer and optimizer are rank 0's, as the dense optimizer spec is).

        Returns:
            True when the tables were created now; False when they existed (a no-op).

        Raises:
            InvalidRequestError: no tables, too many, a name twice.
            PlanMismatchError: tables exist and differ (another model, or a table's dim changed).
            TableFullError: one row of every table exceeds ``max_bytes`` (no row could ever be written).
        """
        if not specs or len(specs) > MAX_TABLES:
            raise InvalidRequestError(f"InitTables declares 1 to {MAX_TABLES} tables, got {len(specs)}.")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise InvalidRequestError("InitTables names a table twice; give every table its own name.")
        if self.tables:
            mine = {name: (t.spec.num_rows, t.spec.dim) for name, t in self.tables.items()}
            theirs = {s.name: (s.num_rows, s.dim) for s in specs}
            if mine != theirs:
                diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
                raise PlanMismatchError(
                    f"Shard {self.shard_index} holds other tables than this model declares (differ in name, num_rows "
                    f"or dim: {diff[:4]}); every worker must build the same embedding tables."
                )
            return False
        smallest = sum(table_row_bytes(s) for s in specs)
        if smallest > self.max_bytes:
            raise TableFullError(
                f"One row of each declared table takes {smallest} bytes (values and optimizer state) but shard "
                f"{self.shard_index} holds at most {self.max_bytes} bytes of tables (--max-table-bytes); nothing was "
                "declared. Raise --max-table-bytes, or declare narrower tables (a smaller dim, or an optimizer "
                "with less state)."
            )
        self.tables = {s.name: self._new_table(s) for s in specs}  # InvalidRequestError: a max_bytes too small
        log.info("shard %d: tables %s declared", self.shard_index, ", ".join(names))
        return True

    def _new_table(self, s: TableSpec) -> Table:
        return Table(s, self.shard_index, self.num_shards, self.max_rows, self.max_bytes, self.clock)

    def expire(self, limit: int | None = EXPIRE_SCAN_ROWS) -> int:
        """Evict expired rows (tables with expiry): at most ``limit`` slots looked at per table (a
        timer tick), None: all (at checkpoint time). Returns the rows evicted."""
        return sum(t.expire(limit) for t in self.tables.values() if t.spec.expires)

    def table(self, name: str) -> Table:
        """The table ``name``.

        Raises:
            PreconditionError: no tables declared. InvalidRequestError: unknown name.
        """
        if not self.tables:
            raise PreconditionError(
                f"Shard {self.shard_index} has no tables yet; call InitTables (PSClient.init does) first."
            )
        t = self.tables.get(name)
        if t is None:
            raise InvalidRequestError(f"Unknown table {name[:80]!r}; this shard's tables: {sorted(self.tables)[:8]}.")
        return t

    # ----------------------------------------------------------------- read
    def pull(self, blocks: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Rows of each (table, ids int64 [n]) block, all checked before any is read, in one hold
        of the lock (the chunked form: :meth:`open_read`).

        Returns:
            float32 [n, dim] per block.

        Raises:
            InvalidRequestError, PreconditionError: as :meth:`table`, :meth:`Table.check_ids`.
        """
        read = self.open_read([RowRequest.of(name, ids, self.num_shards) for name, ids in blocks])
        while read.step():
            pass
        read.close()
        return read.result()

    def open_read(self, requests: Sequence[RowRequest]) -> RowRead:
        """Check a pull's blocks and open a chunked read of them as of the current version (lock
        held); the caller calls :meth:`RowRead.step` (lock held) until it returns False, then
        :meth:`RowRead.close` (lock held) and :meth:`RowRead.result` (no lock).

        Raises:
            InvalidRequestError, PreconditionError: as :meth:`table`, :meth:`Table.check_ids`.
        """
        tables = [self.table(r.table) for r in requests]
        for t, r in zip(tables, requests, strict=True):
            t.check_ids(r.sorted_ids, r.owners)
        read = RowRead(list(zip(tables, requests, strict=True)))
        read.open(self.version)
        return read

    # ----------------------------------------------------------------- push
    def check_push(self, policy: ConsistencyPolicy, blocks: Mapping[str, RowGrads]) -> None:
        """Check a push's blocks before anything is held or applied: tables served in ``policy``'s
        mode, known tables, ids in range and owned here, finite gradients, room for the new rows
        (counting the open round's).

        Raises:
            PreconditionError: the mode serves no tables (``policy.check_rows``), or no tables.
            InvalidRequestError: bad ids or values. TableFullError: the new rows exceed a table's cap.
        """
        policy.check_rows()
        for name, rg in blocks.items():
            t = self.table(name)
            t.check_ids(rg.ids)
            if not bool(torch.isfinite(rg.grads).all()):
                raise InvalidRequestError(
                    f"The gradient of table {name!r} has NaN or infinite rows; nothing was applied. Clip or skip "
                    "the step (GradScaler) before pushing."
                )
        new: dict[str, int] = {}
        for name, t in self.tables.items():  # the rows this push and the open round's pushes would create
            ids = [h[name].ids for h in self.held.values() if name in h]
            if name in blocks:
                ids.append(blocks[name].ids)
            if ids:
                new[name] = t.new_rows(torch.unique(torch.cat(ids)))
                t.check_room(new[name])
        self.check_bytes(new)

    def check_hyperparameters(self, hyper: Mapping[str, float]) -> None:
        """Refuse row optimizer values a push sets (:data:`~ps_common.tables.ROW_HYPERPARAMETERS`)
        that a table's row optimizer does not take per push, or that are out of its range
        (``RowOptimizerSpec``'s checks on the values in force with ``hyper``), or that would
        change the state it keeps (sgd's momentum from 0).

        Raises:
            InvalidRequestError: an unknown name, a value out of range.
        """
        for name, v in hyper.items():
            if not (math.isfinite(v) and v >= 0):
                raise InvalidRequestError(f"Row hyperparameter {name[:64]}={v!r} must be a finite number >= 0.")
        for t in self.tables.values():
            opt = t.spec.optimizer
            allowed = ROW_HYPERPARAMETERS[opt.name]
            unknown = sorted(set(hyper) - allowed)
            if unknown:
                raise InvalidRequestError(
                    f"A row push may set {', '.join(sorted(allowed))} of table {t.spec.name!r}'s {opt.name} row "
                    f"optimizer, not {unknown[0][:64]!r}."
                )
            effective = t.optimizer_with({**self.hyper, **hyper})
            if state_names(effective) != state_names(opt):
                raise InvalidRequestError(
                    f"Table {t.spec.name!r}'s {opt.name} row optimizer keeps no momentum; a push cannot turn it on "
                    "(declare the table with momentum)."
                )

    @property
    def num_bytes(self) -> int:
        """Bytes all tables hold (capacity, optimizer state, ids and index)."""
        return sum(t.num_bytes for t in self.tables.values())

    def check_bytes(self, new: Mapping[str, int]) -> None:
        """Raise TableFullError when holding ``new`` more rows (table name -> count) would take the
        shard's tables beyond ``max_bytes`` (each table at least its current capacity)."""
        needed = sum(t.bytes_with(new.get(name, 0)) for name, t in self.tables.items())
        if needed > self.max_bytes:
            added = sum(new.values())
            raise TableFullError(
                f"Shard {self.shard_index}'s tables hold {self.num_bytes} bytes and this update would add {added} "
                f"rows, {needed} bytes in all (values and optimizer state), beyond --max-table-bytes="
                f"{self.max_bytes}; nothing changed. Raise --max-table-bytes, add shards, or touch fewer rows."
            )

    def push(
        self,
        policy: ConsistencyPolicy,
        rank: int,
        incarnation: int,
        clock: int,
        blocks: Mapping[str, RowGrads],
        hyper: Mapping[str, float] | None = None,
    ) -> tuple[int, bool]:
        """Hold (``policy.row_rounds``) or apply one rank's row gradients of one step.

        ``hyper``: row optimizer values (``{"lr": 0.01}``) for the step and after; a row round
        takes its ranks' (they must agree), an immediate push its own.

        Returns:
            (version: the round joined (row rounds) or the version after the step, duplicate).

        Raises:
            FutureRoundError: row rounds, a clock beyond the open round.
            PreconditionError: row rounds, ``hyper`` differs from another rank's push of the round.
            as :meth:`check_push` and :meth:`check_hyperparameters`; UpdateRefusedError (applied
            at once): the step failed, nothing changed.
        """
        hyper = dict(hyper or {})
        if policy.row_rounds:
            return self._hold(policy, rank, incarnation, clock, blocks, hyper)
        seen = self.high_water.get(rank)
        if seen is not None and seen[0] == incarnation and clock <= seen[1]:
            return self.version, True
        self.check_push(policy, blocks)
        self.check_hyperparameters(hyper)
        self._apply(blocks.items(), count=1, hyper=hyper)
        self.high_water[rank] = (incarnation, clock)
        return self.version, False

    def _hold(
        self,
        policy: ConsistencyPolicy,
        rank: int,
        incarnation: int,
        clock: int,
        blocks: Mapping[str, RowGrads],
        hyper: dict[str, float],
    ) -> tuple[int, bool]:
        """Hold ``rank``'s push for the open table round ``clock`` (a closed round's, or a second
        push of the open round, is a duplicate). Returns (clock, duplicate).

        Raises:
            FutureRoundError: ``clock`` beyond the open round. As :meth:`check_push`.
        """
        if clock < self.version or (clock == self.version and rank in self.held):
            return clock, True
        if clock > self.version:
            raise FutureRoundError(
                f"PushRows for table round {clock}, but shard {self.shard_index} is at round {self.version}; "
                "pull rows and push the round it holds."
            )
        self.check_push(policy, blocks)
        self.check_hyperparameters(hyper)
        if self.held_hyper is not None and hyper != self.held_hyper:
            raise PreconditionError(
                f"Rank {rank} sent row hyperparameters {hyper} for table round {clock}, but another rank sent "
                f"{self.held_hyper}; every rank must step the tables with the same values (the same lr schedule)."
            )
        self.held_hyper = hyper
        self.held[rank] = dict(blocks)
        self.held_keys[rank] = incarnation
        return clock, False

    def advance(self, policy: ConsistencyPolicy, expected: Callable[[int], Iterable[int]]) -> bool:
        """Close the open table round when ``policy`` holds rows in rounds and every rank
        ``expected(round)`` names has pushed it (:meth:`close_round_if_complete`).

        Returns:
            True when a round closed (the version moved).
        """
        return policy.row_rounds and self.close_round_if_complete(expected(self.version))

    def waiting_for(self, expected: Iterable[int]) -> list[int]:
        """Ranks of ``expected`` that have not pushed the open table round, in ``expected``'s order."""
        return [r for r in expected if r not in self.held]

    def close_round_if_complete(self, expected: Iterable[int]) -> bool:
        """Row rounds: apply the open round once every expected rank pushed (and at least one did).

        Returns:
            True when a round closed.
        """
        if not self.held or any(r not in self.held for r in expected):
            return False
        held, self.held, self.held_keys = self.held, {}, {}
        hyper, self.held_hyper = self.held_hyper or {}, None
        ranks = sorted(held)
        per_table: dict[str, list[RowGrads]] = {name: [] for name in self.tables}
        for r in ranks:  # rank order, never arrival order
            for name, rg in held[r].items():
                per_table[name].append(rg)
        try:
            self._apply(per_table.items(), count=len(ranks), parts=True, hyper=hyper)
        except UpdateRefusedError as exc:
            self.refused += 1
            log.warning("shard %d: table round %d refused, rows unchanged: %s", self.shard_index, self.version, exc)
            self.version += 1
        return True

    def _apply(
        self,
        items: Iterable[tuple[str, Any]],
        count: int,
        parts: bool = False,
        hyper: Mapping[str, float] | None = None,
    ) -> None:
        """Coalesce each table's gradients, divide by ``count``, step every table with the values
        in force updated by ``hyper`` (all or nothing: every table's step is computed and checked
        before any is written, and ``hyper`` stays in force only then); version + 1."""
        in_force = {**self.hyper, **(hyper or {})}
        summed = {}
        for name, value in items:
            dim = self.tables[name].spec.dim
            ids, grads = coalesce(value if parts else [value], dim)
            if count > 1:
                grads = grads / count
            summed[name] = (ids, grads)
        empty = torch.empty(0, dtype=torch.int64)
        prepared = [
            (t, t.prepare(*summed.get(name, (empty, None)), overrides=in_force)) for name, t in self.tables.items()
        ]
        self.hyper = in_force
        # every table computed and checked: now write, each table growing within what the byte
        # budget leaves once every other table has room for its own new rows
        floors = {id(t): t.bytes_with(int((~p.held).sum()) if p.held is not None else 0) for t, p in prepared}
        for t, p in prepared:
            others = sum(floors.values()) - floors[id(t)]
            t.commit(p, most=max(0, self.max_bytes - others) // t.bytes_per_row)
            floors[id(t)] = t.num_bytes
        self.version += 1

    # ----------------------------------------------------------------- checkpoints and status
    def export(self) -> dict[str, Any]:
        """Plain data for ``torch.load(weights_only=True)`` (the open table round is left out)."""
        return {
            "version": self.version,
            "tables": [export_table(t) for t in self.tables.values()],
            "high_water": [[r, inc, clock] for r, (inc, clock) in sorted(self.high_water.items())],
            "hyperparameters": dict(self.hyper),
        }

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Load :meth:`export` output (None: a checkpoint without tables, nothing to load).

        Raises:
            CheckpointError: the tables exceed this shard's row or byte bounds (nothing loaded)."""
        if not saved:
            return
        tables = {s.name: self._new_table(s) for s in map(spec_from_export, saved["tables"])}
        for item, table in zip(saved["tables"], tables.values(), strict=True):  # names are unique
            restore_table(table, item)
        check_restored(tables, self.shard_index, self.max_rows, self.max_bytes)  # CheckpointError: too many
        self.tables = tables
        self.version = int(saved["version"])
        self.high_water = {int(r): (int(inc), int(clock)) for r, inc, clock in saved.get("high_water", [])}
        self.held, self.held_keys, self.held_hyper = {}, {}, None
        self.hyper = {str(k): float(v) for k, v in saved.get("hyperparameters", {}).items()}

    def clock_of(self, policy: ConsistencyPolicy, rank: int, incarnation: int) -> int:
        """The clock ``rank``'s next push carries (``policy.row_clock``: the open round in row
        rounds, else one past its high-water mark)."""
        seen = self.high_water.get(rank)
        return policy.row_clock(self.version, seen[1] if seen is not None else None)
