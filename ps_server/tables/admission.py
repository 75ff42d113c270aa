"""The admission filter of one embedding table: how many times each id not stored yet was pushed,
in a bounded count-min sketch (docs/tables.md#admission-expiry-and-an-lru-bound).

A count-min sketch (Cormode and Muthukrishnan, "An improved data stream summary: the count-min
sketch and its applications", J. Algorithms 55(1), 2005) of :data:`DEPTH` rows of ``width``
saturating uint8 counters, updated conservatively (:meth:`AdmissionFilter.add`): an id's count is
the smallest of its ``DEPTH`` counters (one per row, at ``mix64(id ^ salt_row) % width``).
Collisions only add, so the estimate is never below the
true count: a row may be **admitted early** (when other ids share all its counters), **never
late**. Expected excess at most ``e * pushes / width`` with probability ``1 - e**-DEPTH``
(Cormode and Muthukrishnan, theorem 1).

With expiry the sketch also forgets, as the frequency filter of Monolith (arXiv:2209.07663,
section 3.2) meets expiring embeddings: two generations, ``current`` and ``previous``; every half
expiry window (``expire_after_rounds / 2`` table steps or ``expire_after_seconds / 2`` seconds)
``previous`` is dropped and ``current`` becomes it (the "reset" of TinyLFU, Einziger, Friedman,
Manes, ACM ToS 2017, by generations). An id's count is the sum over both, so pushes of the last
half window always count and pushes older than a whole window never do: a row that expired comes
back through admission again. Pure numpy: no lock, no grpc.
"""

from __future__ import annotations

import numpy as np
import torch

from ps_common.tables import mix64

DEPTH = 4
"""Rows of the sketch (independent hashes)."""

MIN_FILTER_BYTES = 64 * 1024
MAX_FILTER_BYTES = 64 * 1024**2
FILTER_FRACTION = 64
"""A filter takes 1/64 of its table's bound (``max_bytes``, else the shard's ``--max-table-bytes``),
clamped to [64 KiB, 64 MiB]."""

_SALTS = np.array([0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89], dtype=np.uint64)


def filter_bytes(bound: int) -> int:
    """The bytes the filter of a table bounded by ``bound`` bytes may take (see :data:`FILTER_FRACTION`)."""
    return int(min(MAX_FILTER_BYTES, max(MIN_FILTER_BYTES, bound // FILTER_FRACTION)))


class AdmissionFilter:
    """Counts of pushes of ids not stored yet, in ``budget`` bytes at most.

    Args:
        budget: bytes the counters may take (:func:`filter_bytes`).
        generations: 1 (counts never forgotten) or 2 (with expiry: see the module docstring).
        ids: how many distinct ids there can be (a table's rows on one shard): the sketch is no
            wider than the power of two at or above twice that (nearly exact already).
    """

    def __init__(self, budget: int, generations: int, ids: int = 2**62) -> None:
        width = 1
        while DEPTH * generations * width * 2 <= budget and width < 2 * ids:
            width *= 2
        self.width = width
        self.current = np.zeros((DEPTH, width), dtype=np.uint8)
        self.previous = np.zeros((DEPTH, width), dtype=np.uint8) if generations == 2 else None

    @property
    def num_bytes(self) -> int:
        """Bytes of the counters."""
        return self.current.nbytes + (self.previous.nbytes if self.previous is not None else 0)

    def _cells(self, ids: torch.Tensor) -> np.ndarray:
        raw = ids.detach().cpu().contiguous().numpy().astype(np.int64, copy=False).view(np.uint64)
        mixed = mix64(raw[None, :] ^ _SALTS[:, None])
        return (mixed & np.uint64(self.width - 1)).astype(np.int64)  # [DEPTH, n]; width is a power of 2

    def estimate(self, ids: torch.Tensor) -> torch.Tensor:
        """Pushes counted for each of ``ids`` (int64 [n]): never below the true count. Returns int64 [n]."""
        if ids.numel() == 0:
            return torch.zeros(0, dtype=torch.int64)
        cells = self._cells(ids)
        rows = np.arange(DEPTH)[:, None]
        counts = self.current[rows, cells].astype(np.int64)
        if self.previous is not None:
            counts += self.previous[rows, cells]
        return torch.from_numpy(counts.min(axis=0))

    def add(self, ids: torch.Tensor) -> None:
        """Count one push of each of ``ids`` (int64 [n], distinct), by conservative update (Estan
        and Varghese, SIGCOMM 2002): each of an id's counters rises only to its estimate + 1, so
        every id's counters stay at least its count while colliding ids inflate each other less.
        Counters saturate at 255."""
        if ids.numel() == 0:
            return
        cells = self._cells(ids)
        rows = np.arange(DEPTH)[:, None]
        previous = self.previous[rows, cells].astype(np.int64) if self.previous is not None else 0
        target = self.estimate(ids).numpy()[None, :] + 1 - previous
        target = np.broadcast_to(np.clip(target, 0, 255).astype(np.uint8), cells.shape)  # [DEPTH, n]
        for d in range(DEPTH):  # ids sharing a cell: the largest target wins
            np.maximum.at(self.current[d], cells[d], target[d])

    def rotate(self) -> None:
        """Forget the older generation (with two; a no-op with one)."""
        if self.previous is not None:
            self.previous, self.current = self.current, self.previous
            self.current.fill(0)

    def export(self) -> dict[str, torch.Tensor]:
        """The counters as uint8 tensors (for checkpoints)."""
        out = {"current": torch.from_numpy(self.current.copy())}
        if self.previous is not None:
            out["previous"] = torch.from_numpy(self.previous.copy())
        return out

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        """Load :meth:`export` output of a filter of any power-of-two width (another shard count or
        byte budget): folded onto this width when wider (cells that share their low bits summed),
        repeated when narrower, so no id's estimate drops below what it was; another depth is
        ignored (this one's zeros are kept)."""
        current = _fit(saved.get("current"), self.width)
        if current is None:
            return
        self.current = current
        previous = _fit(saved.get("previous"), self.width)
        if self.previous is not None and previous is not None:
            self.previous = previous


def _fit(saved: torch.Tensor | None, width: int) -> np.ndarray | None:
    """Counters ``saved`` (uint8 [DEPTH, w], w a power of two) on ``width`` cells per row: an id's
    cell is ``mix64(...) & (width - 1)``, so a wider sketch folds (sum of the cells with the same low
    bits, saturating) and a narrower one repeats. None: not a sketch of this depth."""
    if saved is None or saved.dim() != 2 or saved.shape[0] != DEPTH:
        return None
    w = int(saved.shape[1])
    if w < 1 or w & (w - 1):
        return None
    counts = saved.numpy().astype(np.int64)
    if w > width:
        counts = counts.reshape(DEPTH, w // width, width).sum(axis=1)
    elif w < width:
        counts = np.tile(counts, (1, width // w))
    return np.minimum(counts, 255).astype(np.uint8)
