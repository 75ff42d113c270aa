"""Ranks as one shard sees them: incarnations, leases, clocks, and the answers of recent pushes.

Pure bookkeeping with an injected clock; the :class:`~ps_server.shard.Shard` holds the lock.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ps_server.core.errors import InvalidRequestError, NotJoinedError, SupersededError

log = logging.getLogger(__name__)

PUSH_HISTORY = 64
"""Answers remembered per rank for duplicate pushes (retries resend the same clock)."""


class WorkerState(enum.Enum):
    PENDING = "pending"
    LIVE = "live"
    EVICTED = "evicted"
    LEFT = "left"


@dataclass(frozen=True)
class PushResult:
    """Answer to a push: the version it was accepted at, its staleness in versions, whether it
    repeated an earlier push, and whether a quorum round had closed without it (dropped)."""

    version: int
    staleness: int = 0
    duplicate: bool = False
    dropped: bool = False
    mode: str = "sync"


@dataclass
class Member:
    """One rank as this shard sees it."""

    rank: int
    incarnation: int = 0
    state: WorkerState = WorkerState.PENDING
    clock: int = 0
    last_seen: float | None = None
    pushes: int = 0
    history: OrderedDict[tuple[int, int], PushResult] = field(default_factory=OrderedDict)
    # EASGD: ((incarnation, clock), version, d) of the last exchange, for retries.
    last_exchange: tuple[tuple[int, int], int, list[torch.Tensor]] | None = None


@dataclass(frozen=True)
class MemberView:
    rank: int
    incarnation: int
    clock: int
    state: WorkerState
    last_seen_seconds_ago: float
    pushes: int


class Membership:
    """The ranks ``0..num_workers-1`` of a cluster.

    Args:
        num_workers: ranks in the cluster.
        lease_timeout: seconds of silence after which a live rank is evicted.
        now: monotonic clock in seconds.
        join_timeout: seconds from the first Join after which ranks that never joined are reported
            missing (:class:`JoinDeadline`); 0 waits for them forever.
    """

    def __init__(
        self, num_workers: int, lease_timeout: float, now: Callable[[], float], join_timeout: float = 0.0
    ) -> None:
        self.num_workers = num_workers
        self.lease_timeout = lease_timeout
        self.now = now
        self.members = [Member(rank=r) for r in range(num_workers)]
        self.joins = JoinDeadline(join_timeout, now)

    def get(self, rank: int, incarnation: int | None = None) -> Member:
        """The member ``rank``.

        Raises:
            InvalidRequestError: rank out of range.
            SupersededError: ``incarnation`` is older than the one joined.
        """
        if not 0 <= rank < self.num_workers:
            raise InvalidRequestError(
                f"Rank {rank} is out of range: this cluster has num_workers={self.num_workers} "
                f"(ranks 0..{self.num_workers - 1})."
            )
        member = self.members[rank]
        if incarnation is not None and incarnation < member.incarnation:
            raise SupersededError(
                f"Rank {rank} incarnation {incarnation} was superseded by incarnation "
                f"{member.incarnation}; this process is stale and should exit."
            )
        return member

    @staticmethod
    def check_live(member: Member, incarnation: int) -> None:
        """Raise NotJoinedError unless ``member`` is live under ``incarnation``."""
        if member.state is not WorkerState.LIVE or incarnation != member.incarnation:
            raise NotJoinedError(
                f"Rank {member.rank} incarnation {incarnation} is not joined here "
                f"(state {member.state.value}); call Join again, then pull."
            )

    def expected(self) -> list[int]:
        """Ranks rounds and SSP reads wait for: joined and live, or not joined yet."""
        return [m.rank for m in self.members if m.state in (WorkerState.PENDING, WorkerState.LIVE)]

    def clocks(self) -> list[int]:
        """Clocks of the :meth:`expected` ranks."""
        return [self.members[r].clock for r in self.expected()]

    def touch(self, member: Member) -> None:
        """Renew ``member``'s lease."""
        member.last_seen = self.now()

    @staticmethod
    def remember(member: Member, incarnation: int, clock: int, result: PushResult) -> PushResult:
        """Keep ``result`` as the answer to a repeat of (rank, incarnation, clock)."""
        member.history[(incarnation, clock)] = result
        while len(member.history) > PUSH_HISTORY:
            member.history.popitem(last=False)
        return result

    def expire(self) -> list[tuple[int, float]]:
        """Evict live ranks silent past the lease; returns (rank, seconds silent) of each."""
        now = self.now()
        evicted = []
        for m in self.members:
            silent = None if m.last_seen is None else now - m.last_seen
            if m.state is WorkerState.LIVE and silent is not None and silent > self.lease_timeout:
                m.state = WorkerState.EVICTED
                evicted.append((m.rank, silent))
        return evicted

    def views(self) -> tuple[MemberView, ...]:
        now = self.now()
        return tuple(
            MemberView(
                m.rank, m.incarnation, m.clock, m.state, -1.0 if m.last_seen is None else now - m.last_seen, m.pushes
            )
            for m in self.members
        )

    def export(self) -> list[dict[str, Any]]:
        """Plain data of every member for a checkpoint (push history is not kept)."""
        return [
            {"rank": m.rank, "incarnation": m.incarnation, "clock": m.clock, "state": m.state.value, "pushes": m.pushes}
            for m in self.members
        ]

    def restore(self, saved: list[dict[str, Any]]) -> None:
        """Members from :meth:`export`; live ranks get a fresh lease to come back in, and ranks saved
        as LEFT (they finished) are PENDING again: a job run again on its checkpoints goes on with
        every rank, awaited as at a first start (up to the join deadline), not with whoever rejoins
        first. Evicted ranks stay evicted (they rejoin with a restart)."""
        now = self.now()
        for m, s in zip(self.members, saved, strict=True):
            m.incarnation, m.clock, m.pushes = int(s["incarnation"]), int(s["clock"]), int(s["pushes"])
            m.state = WorkerState(s["state"])
            if m.state is WorkerState.LEFT:
                m.state = WorkerState.PENDING
            m.last_seen = now if m.state is WorkerState.LIVE else None
            m.history.clear()
            m.last_exchange = None


class JoinDeadline:
    """How long ranks that never joined are waited for (``--join-timeout``), like the rendezvous
    timeout of ``torchrun``: counted from the first Join of any rank, so a cluster whose shards
    start long before their workers does not use it up; only the spread of the ranks' arrivals does.

    Pure bookkeeping with an injected clock; the shard holds the lock.

    Args:
        timeout: seconds after the first Join; 0 (or less) waits forever.
        now: monotonic clock in seconds.
    """

    def __init__(self, timeout: float, now: Callable[[], float]) -> None:
        self.timeout = timeout
        self.now = now
        self.started: float | None = None
        self.reported = False

    def start(self) -> None:
        """Start the clock (called at every Join; only the first one counts)."""
        if self.started is None:
            self.started = self.now()

    def due(self) -> float | None:
        """When ranks still not joined count as missing (on the :attr:`now` clock); None before the
        first Join or without a timeout."""
        if self.started is None or self.timeout <= 0:
            return None
        return self.started + self.timeout

    def missing(self, members: Sequence[Member]) -> list[int]:
        """Ranks of ``members`` that are still PENDING once the deadline has passed ([] before)."""
        due = self.due()
        if due is None or self.now() < due:
            return []
        return [m.rank for m in members if m.state is WorkerState.PENDING]

    def describe(self, missing: Sequence[int], shard_index: int) -> str:
        """The refusal and log text naming the ``missing`` ranks and what to do."""
        ranks = list(missing)
        return (
            f"Ranks {ranks} never joined shard {shard_index} within --join-timeout {self.timeout:g} s of the "
            f"first Join; the job cannot go on without them: start them (same --servers and --num-workers), "
            f"or go on without them with `ps-admin evict {ranks[0]}` for each, or raise --join-timeout."
        )
