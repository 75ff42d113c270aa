"""Stale synchronous parallel (SSP) reads with staleness bound s.

Pushes apply at once, as in async. A pull by a worker at clock c (it has completed c steps) waits
until the slowest live worker's clock is at least c - s, so a worker never computes on parameters
more than s clocks ahead of the slowest live worker. s = 0 is BSP's read barrier. (Ho, Cipar,
Cui, et al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter Server",
NIPS 2013, section 3.)
"""

from __future__ import annotations

from collections.abc import Iterable

from ps_server.membership.ranks import Member, WorkerState
from ps_server.policy.asynchronous import ImmediatePolicy
from ps_server.policy.base import ShardCore
from ps_server.policy.types import Awaited


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


class SspPolicy(ImmediatePolicy):
    """SSP: pushes apply at once as in async (learning-rate scale 1, never refused as stale); a read
    by a rank at clock c waits until every live rank's clock is >= c - s (Ho et al. 2013)."""

    mode = "ssp"
    staleness_unit = "clocks"

    def join_clock(self, shard: ShardCore, member: Member, restarted: bool) -> int:
        """A restarted rank resumes at the slowest live clock, so it neither blocks nor races."""
        if not restarted:
            return member.clock
        others = [m.clock for m in shard.members if m.state is WorkerState.LIVE and m is not member]
        return min(others, default=member.clock)

    def can_read(self, shard: ShardCore, member: Member, joined: bool, min_version: int) -> bool:
        """A joined rank reads once the slowest live rank is at most s clocks behind it."""
        return not joined or can_read(member.clock, shard.membership.clocks(), shard.settings.staleness)

    def blocked(self, shard: ShardCore, member: Member, min_version: int, timeout: float | None) -> str:
        return (
            f"Rank {member.rank} at clock {member.clock} may read once every live rank reaches clock "
            f"{member.clock - shard.settings.staleness} (slowest: {slowest(shard.membership.clocks())}); "
            "check the slow workers."
        )

    def awaited(self, shard: ShardCore, member: Member, min_version: int) -> Awaited | None:
        """The live ranks more than s clocks behind the reader."""
        floor = member.clock - shard.settings.staleness
        ranks = [r for r in shard.membership.expected() if shard.membership.members[r].clock < floor]
        staleness = shard.settings.staleness
        return Awaited(f"clock {floor} of every rank (staleness {staleness})", ranks, f"reached clock {floor}")

    def after_read(self, shard: ShardCore, member: Member, joined: bool, min_version: int) -> None:
        """Record the reader's lead over the slowest live rank (the status's ``max_clock_gap``)."""
        if joined:
            shard.max_clock_gap = max(shard.max_clock_gap, read_gap(member.clock, shard.membership.clocks()))

    def staleness(self, shard: ShardCore, member: Member, grad_version: int) -> int:
        """The clock gap: ``member``'s lead over the slowest live rank, in clocks (docs/architecture.md#3-staleness)."""
        return read_gap(member.clock, shard.membership.clocks())
