"""Stale synchronous parallel (SSP) reads with staleness bound s.

Pushes apply at once, as in async. A pull by a worker at clock c (it has completed c steps) waits
until the slowest live worker's clock is at least c - s, so a worker never computes on parameters
more than s clocks ahead of the slowest live worker. s = 0 is BSP's read barrier. (Ho, Cipar,
Cui, et al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter Server",
NIPS 2013, section 3.)
"""

from __future__ import annotations

from collections.abc import Iterable


def slowest(clocks: Iterable[int]) -> int | None:
    """The lowest clock among live ranks, or None when no rank is live."""
    return min(clocks, default=None)


def can_read(clock: int, live_clocks: Iterable[int], s: int) -> bool:
    """True when a worker at ``clock`` may read: every live rank's clock is >= clock - s.

    With no live rank (everyone left or was evicted) reads never block.
    """
    low = slowest(live_clocks)
    return low is None or low >= clock - s


def read_gap(clock: int, live_clocks: Iterable[int]) -> int:
    """The reader's lead over the slowest live rank, in clocks (0 when it is not ahead)."""
    low = slowest(live_clocks)
    return 0 if low is None else max(0, clock - low)
