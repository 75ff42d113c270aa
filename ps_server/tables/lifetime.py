"""When the rows of one embedding table come and go: admission, last-push stamps, expiry and
least-recently-used victims (docs/tables.md#admission-expiry-and-an-lru-bound).

A :class:`RowLife` belongs to one :class:`~ps_server.tables.table.Table` and keeps, per slot of its
storage, when the row there was last **pushed** (the table's step, and wall-clock seconds; pulls do
not count: a training step pushes every row it pulled); the table's
:class:`~ps_server.tables.admission.AdmissionFilter` when ``admit_after > 1``; and the counts of
rows admitted and evicted. It chooses victims; the table evicts them. Pure torch: no lock, no grpc.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ps_common.tables import TableSpec
from ps_server.tables.admission import AdmissionFilter, filter_bytes

EXPIRE_SCAN_ROWS = 262144
"""Most slots one timer tick looks at per table for expired rows (about 2 ms of work)."""

LRU_HEADROOM = 64
"""An LRU eviction frees 1/64 of the table's bound beyond what a push needs, so the O(rows)
choice of victims runs at most once per that many new rows."""


class RowLife:
    """Admission, stamps and eviction counts of one table (see the module docstring).

    Args:
        spec: the table.
        bound: the table's bound in bytes (``spec.max_bytes``, else the shard's budget), which sizes
            the admission filter.
        clock: wall-clock seconds (stamps survive a restart, so not a monotonic clock).
        num_shards: shards the table's ids are spread over (a small table's filter is smaller).
    """

    def __init__(self, spec: TableSpec, bound: int, clock: Callable[[], float], num_shards: int = 1) -> None:
        self.spec = spec
        self.clock = clock
        generations = 2 if spec.expires else 1
        ids = -(-spec.num_rows // num_shards)  # the most distinct ids one shard sees
        self.filter = AdmissionFilter(filter_bytes(bound), generations, ids) if spec.admits else None
        self.step_stamp = torch.empty(0, dtype=torch.int64)  # per slot: the table step of the last push
        self.time_stamp = torch.empty(0, dtype=torch.float64)  # per slot: its wall-clock seconds
        self.rotated_step = 0
        self.rotated_at = clock()
        self.admitted = 0
        self.evicted = {"expired": 0, "lru": 0}
        self.cursor = 0  # where the next expiry scan starts

    @property
    def filter_bytes(self) -> int:
        return self.filter.num_bytes if self.filter is not None else 0

    def grow(self, extra: int) -> None:
        """Room for ``extra`` more slots."""
        self.step_stamp = torch.cat([self.step_stamp, torch.zeros(extra, dtype=torch.int64)])
        self.time_stamp = torch.cat([self.time_stamp, torch.zeros(extra, dtype=torch.float64)])

    def touch(self, slots: torch.Tensor, step: int) -> None:
        """Rows at ``slots`` (int64 [m]) were pushed at table step ``step``, now."""
        self.step_stamp[slots] = step
        self.time_stamp[slots] = self.clock()

    # ----------------------------------------------------------------- admission
    def admit(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` (int64 [n], not stored) a push now stores: pushed ``admit_after - 1``
        times before (as the filter counts). Returns bool [n]; changes nothing."""
        if self.filter is None:
            return torch.ones(ids.numel(), dtype=torch.bool)
        return self.filter.estimate(ids) + 1 >= self.spec.admit_after

    def count(self, pending: torch.Tensor, admitted: int) -> None:
        """A step was written: ``pending`` (int64 [p]) were pushed and not stored, ``admitted`` rows were."""
        if self.filter is not None:
            self.filter.add(pending)
        self.admitted += admitted

    def rotate_if_due(self, step: int) -> None:
        """Forget the filter's older generation every half expiry window (rounds or seconds)."""
        if self.filter is None or not self.spec.expires:
            return
        rounds, seconds = self.spec.expire_after_rounds, self.spec.expire_after_seconds
        now = self.clock()
        if (rounds and step - self.rotated_step >= max(1, rounds // 2)) or (
            seconds and now - self.rotated_at >= seconds / 2
        ):
            self.filter.rotate()
            self.rotated_step, self.rotated_at = step, now

    # ----------------------------------------------------------------- victims
    def expired(self, live: torch.Tensor, step: int, limit: int | None) -> torch.Tensor:
        """Slots of expired rows among the next ``limit`` slots of ``live`` (bool [used]: slot holds a
        row) from the scan cursor (None: all). Returns int64 [m]."""
        used = live.numel()
        if not self.spec.expires or used == 0:
            return torch.empty(0, dtype=torch.int64)
        start = self.cursor if self.cursor < used else 0
        stop = used if limit is None else min(used, start + limit)
        if limit is None:
            start = 0
        self.cursor = 0 if stop >= used else stop
        old = torch.zeros(stop - start, dtype=torch.bool)
        if self.spec.expire_after_rounds:
            old |= self.step_stamp[start:stop] <= step - self.spec.expire_after_rounds
        if self.spec.expire_after_seconds:
            old |= self.time_stamp[start:stop] <= self.clock() - self.spec.expire_after_seconds
        return (old & live[start:stop]).nonzero().squeeze(1) + start

    def least_recent(self, live: torch.Tensor, keep: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` live slots (``live`` bool [used]) pushed longest ago, none of ``keep``
        (int64 slots). Returns int64 [<= count]."""
        stamps = self.step_stamp[: live.numel()].clone()
        top = torch.iinfo(torch.int64).max
        stamps[~live] = top
        stamps[keep] = top
        count = min(count, int((stamps < top).sum()))
        if count <= 0:
            return torch.empty(0, dtype=torch.int64)
        return torch.topk(stamps, count, largest=False, sorted=False).indices

    # ----------------------------------------------------------------- checkpoints
    def export(self, slots: torch.Tensor) -> dict[str, Any]:
        """Stamps of the rows at ``slots`` (in the table's export order), the filter and counts."""
        return {
            "step_stamp": self.step_stamp[slots].clone(),
            "time_stamp": self.time_stamp[slots].clone(),
            "filter": self.filter.export() if self.filter is not None else {},
            "rotated_step": self.rotated_step,
            "rotated_at": self.rotated_at,
            "admitted": self.admitted,
            "evicted_expired": self.evicted["expired"],
            "evicted_lru": self.evicted["lru"],
        }

    def restore(self, saved: dict[str, Any] | None, rows: int, step: int) -> None:
        """Load :meth:`export` output for ``rows`` rows at slots ``0..rows-1``; without it (a
        checkpoint from before expiry existed), every row counts as pushed at ``step``, now."""
        self.step_stamp = torch.full((rows,), step, dtype=torch.int64)
        self.time_stamp = torch.full((rows,), self.clock(), dtype=torch.float64)
        if not saved:
            return
        self.step_stamp = saved["step_stamp"].to(torch.int64).clone()
        self.time_stamp = saved["time_stamp"].to(torch.float64).clone()
        if self.filter is not None:
            self.filter.restore(saved.get("filter", {}))
        self.rotated_step = int(saved.get("rotated_step", step))
        self.rotated_at = float(saved.get("rotated_at", self.clock()))
        self.admitted = int(saved.get("admitted", 0))
        self.evicted = {"expired": int(saved.get("evicted_expired", 0)), "lru": int(saved.get("evicted_lru", 0))}
