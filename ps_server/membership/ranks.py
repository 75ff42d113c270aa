"""Ranks as one shard sees them: incarnations, leases, clocks, and the answers of recent pushes.

Pure bookkeeping with an injected clock; the :class:`~ps_server.shard.shard.Shard` holds the lock.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ps_common.errors import InvalidRequestError, NotJoinedError, ReplayedPushError, SupersededError

log = logging.getLogger(__name__)

PUSH_HISTORY = 64
"""Answers remembered per rank for duplicate pushes (retries resend the same clock)."""


class WorkerState(enum.Enum):
    PENDING = "pending"
    LIVE = "live"
    EVICTED = "evicted"
    LEFT = "left"


@dataclass(frozen=True)
class PushStamp:
    """What makes a push (or an exchange) unique (docs/architecture.md#4-idempotence-and-errors): the rank, the
    incarnation of its process, and its clock (the step it completes). A shard applies each stamp at most once."""

    rank: int
    incarnation: int
    clock: int
    samples: int | None = None
    """diloco: the samples the push's outer gradient stands for (its FedAvg weight; 0: it weighs
    nothing); None: the rank does not count them (a plain mean when no rank does)."""


@dataclass(frozen=True)
class PushResult:
    """Answer to a push: the version it was accepted at, its staleness in versions, whether it
    repeated an earlier push, and whether a quorum round had closed without it (dropped)."""

    version: int
    staleness: int = 0
    duplicate: bool = False
    dropped: bool = False
    mode: str = "sync"
    skipped: bool = False
    """The optimizer step this push joined was skipped (AMP overflow on some rank)."""


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
    # The highest clock applied under ``incarnation`` (async, ssp pushes; easgd exchanges); -1: none.
    # With ``history`` it makes every (rank, incarnation, clock) apply at most once.
    high_water: int = -1
    # EASGD: ((incarnation, clock), version, d) of the last exchange, for retries.
    last_exchange: tuple[tuple[int, int], int, list[torch.Tensor]] | None = None
    # Whether the cluster counts this rank in rounds and waits: the membership authority's decision
    # (ps_server.membership.epochs), the same on every shard; ``state`` is whether it joined *this* shard.
    counted: bool = True
    # sync: the first round the cluster counts it in (a rejoin after an eviction starts at shard 0's
    # next round, on every shard); earlier rounds neither wait for it nor take its pushes.
    since: int = 0
    # sync: its pushes count in the rounds below this one (those that reached shard 0 before it
    # was evicted or left: shard 0's decision), on every shard; 0: none before ``since``.
    until: int = 0
    until_incarnation: int = 0  # the incarnation whose pushes those are (a new process pushes none of them)
    # Restored from a checkpoint and not joined since: its first Join resumes the job, it is no restart.
    restored: bool = False
    # The session of the rank's newest Join here (random 64-bit, nonzero; 0: not joined since this
    # shard started): every push-type request stamped with this rank must carry it. Never checkpointed:
    # a restarted shard refuses every session until the rank joins again.
    session: int = 0


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
        # a resize (ps_server.membership.epochs) keeps ranks < previous_num_workers for rounds < resize_version
        self.previous_num_workers = num_workers
        self.resize_version = 0
        self.lease_timeout = lease_timeout
        self.now = now
        self.members = [Member(rank=r) for r in range(num_workers)]
        self.joins = JoinDeadline(join_timeout, now)
        self._last_expire = now()  # the shard's start counts as the reaper's first wake-up
        self._resumed: float | None = None

    def get(self, rank: int, incarnation: int | None = None) -> Member:
        """The member ``rank``.

        Raises:
            InvalidRequestError: rank out of range.
            SupersededError: ``incarnation`` is older than the one joined.
        """
        if not 0 <= rank < len(self.members):
            raise InvalidRequestError(
                f"Rank {rank} is out of range: this cluster has num_workers={self.num_workers} "
                f"(ranks 0..{self.num_workers - 1}); to grow it: `ps-admin resize {rank + 1}`."
            )
        member = self.members[rank]
        if incarnation is not None and incarnation < member.incarnation:
            raise SupersededError(
                f"Rank {rank} incarnation {incarnation} was superseded by incarnation "
                f"{member.incarnation}; this process is stale and should exit."
            )
        return member

    @staticmethod
    def counts_old_push(member: Member, incarnation: int, round: int) -> bool:
        """sync: whether ``round`` is one the cluster counts the incarnation's push in although it
        no longer counts the rank (below its ``until``, pushed by the incarnation it was decided for)."""
        return round < member.until and incarnation == member.until_incarnation == member.incarnation

    @staticmethod
    def check_live(member: Member, incarnation: int, round: int | None = None) -> None:
        """Raise NotJoinedError unless ``member`` is live under ``incarnation`` (or, sync, pushes
        ``round`` below its ``until``: a round its evicted incarnation still counts in)."""
        if round is not None and Membership.counts_old_push(member, incarnation, round):
            return
        if member.state is not WorkerState.LIVE or incarnation != member.incarnation:
            raise NotJoinedError(
                f"Rank {member.rank} incarnation {incarnation} is not joined here "
                f"(state {member.state.value}); call Join again, then pull."
            )

    def size(self, round: int | None = None) -> int:
        """The worker count in force for ``round`` (None: the newest): a resize holds from its
        ``resize_version`` on."""
        if round is not None and round < self.resize_version:
            return self.previous_num_workers
        return self.num_workers

    def expected(self, round: int | None = None) -> list[int]:
        """Ranks rounds and SSP reads wait for: those the cluster counts (the authority's decision)
        within the worker count in force for ``round`` (None: the newest)."""
        n = self.size(round)
        return [m.rank for m in self.members[:n] if m.counted and (round is None or m.since <= round)]

    def counted_in(self, round: int) -> list[int]:
        """sync: the ranks whose pushes sync round ``round`` takes, by shard 0's decisions: those
        counted from ``since`` on, and an evicted (or left) rank's pushes of the rounds below its
        ``until`` (they reached shard 0 before the decision; docs/faults.md#rounds-atomic-across-shards).
        A round closes when each of them pushed it: on every shard the same ranks."""
        n = self.size(round)
        return [m.rank for m in self.members[:n] if round < m.until or (m.counted and m.since <= round)]

    def clocks(self) -> list[int]:
        """Clocks of the :meth:`expected` ranks."""
        return [self.members[r].clock for r in self.expected()]

    def check_in_cluster(self, rank: int, round: int | None = None) -> None:
        """Raise NotJoinedError when a resize left ``rank`` out of the cluster for ``round``."""
        n = self.size(round)
        if rank >= n:
            raise NotJoinedError(
                f"Rank {rank} is not in the cluster{'' if round is None else f' at round {round}'}: it was "
                f"resized to num_workers={n} (ranks 0..{n - 1}); this rank's work is done, it should exit."
            )

    def pending_resize(self) -> bool:
        """A resize is decided and not yet in force (:meth:`settle` has not reached its version)."""
        return self.previous_num_workers != self.num_workers

    def resize(self, num_workers: int, at_version: int) -> None:
        """Make ranks ``0..num_workers-1`` the cluster from version (sync: round) ``at_version``
        on; new ranks are PENDING and counted, ranks beyond stay for the rounds before it.

        A resize supersedes one still pending (decided, its version not reached): the rounds before
        ``at_version`` keep the count in force before the pending one (``previous_num_workers``
        stays), so no round waits for a rank that only the superseded resize added. Ranks the
        pending resize added and this one keeps are kept as they are (they may have joined)."""
        if num_workers == self.num_workers and at_version == self.resize_version:
            return
        in_force = self.previous_num_workers  # the count of the rounds before any pending resize
        fresh_from = max(self.num_workers, in_force)  # ranks below are members already
        self.num_workers, self.previous_num_workers = num_workers, in_force
        self.resize_version = at_version
        for r in range(fresh_from, num_workers):  # new ranks (again): a fresh start
            if r < len(self.members):
                self.members[r] = Member(rank=r)
            else:
                self.members.append(Member(rank=r))
        if not self.pending_resize():  # back to the count in force: ranks a pending resize added go
            for m in self.members[num_workers:]:
                m.counted = False

    def settle(self, version: int) -> None:
        """Stop counting the ranks a resize removed once ``version`` reached its ``resize_version``
        (they stay listed: they still read that version, then leave)."""
        if version >= self.resize_version and self.previous_num_workers != self.num_workers:
            for m in self.members[self.num_workers :]:
                m.counted = False
            self.previous_num_workers = self.num_workers

    @staticmethod
    def check_replay(member: Member, incarnation: int, clock: int, what: str = "Push") -> None:
        """Refuse a (rank, incarnation, clock) at or below the rank's high-water mark that the
        caller did not find in the remembered answers: applied already (or skipped), and too old
        to be answered again.

        Raises:
            ReplayedPushError: such a clock.
        """
        if incarnation == member.incarnation and clock <= member.high_water:
            raise ReplayedPushError(
                f"{what} of rank {member.rank} incarnation {incarnation} clock {clock} is a replay: this shard "
                f"applied clock {member.high_water} of it already and remembers only the last {PUSH_HISTORY} "
                "answers; it is not applied again. Pull and push the next clock."
            )

    @staticmethod
    def applied(member: Member, incarnation: int, clock: int) -> None:
        """Raise ``member``'s high-water mark to ``clock`` (an update of it was applied)."""
        if incarnation == member.incarnation:
            member.high_water = max(member.high_water, clock)

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
        """Evict live ranks silent past the lease; returns (rank, seconds silent) of each.

        Called periodically (at least every quarter lease). Only the workers' silence counts, not
        the shard's: when more than half a lease passed since the previous call, the shard itself
        stood still (SIGSTOP, CPU starvation, a suspended VM) and heard nobody, so every lease
        restarts from now: silence is measured from the later of the last heartbeat and the end of
        the shard's last pause.
        """
        now = self.now()
        if now - self._last_expire > self.lease_timeout / 2:
            log.warning(
                "the shard stood still for %.1f s (paused or starved of CPU); every live rank gets a fresh lease",
                now - self._last_expire,
            )
            self._resumed = now
        self._last_expire = now
        evicted = []
        for m in self.members:
            seen = m.last_seen if self._resumed is None or m.last_seen is None else max(m.last_seen, self._resumed)
            silent = None if seen is None else now - seen
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

    def export(self, held: Mapping[int, int] | None = None) -> list[dict[str, Any]]:
        """Plain data of every member for a checkpoint, with its high-water mark and remembered
        answers, so a restarted shard applies no (rank, incarnation, clock) twice either.

        Args:
            held: rank -> clock of a push the shard holds but has not applied (a sync round still
                open), which the checkpoint leaves out: it is exported as never received (no
                remembered answer, the rank's clock before it), so that after a restart the
                rank's push of that clock is taken again rather than answered as a duplicate.
        """
        held = held or {}

        def kept(m: Member) -> list[list[Any]]:
            out = held.get(m.rank)
            return [
                [inc, clock, r.version, r.staleness, int(r.duplicate), int(r.dropped), r.mode]
                for (inc, clock), r in m.history.items()
                if not (clock == out and inc == m.incarnation)
            ]

        return [
            {
                "rank": m.rank,
                "incarnation": m.incarnation,
                "clock": min(m.clock, held[m.rank]) if m.rank in held else m.clock,
                "state": m.state.value,
                "pushes": m.pushes,
                "high_water": m.high_water,
                "counted": int(m.counted),
                "since": m.since,
                "until": m.until,
                "until_incarnation": m.until_incarnation,
                "history": kept(m),
            }
            for m in self.members
        ]

    def restore(self, saved: list[dict[str, Any]]) -> None:
        """Members from :meth:`export` (checkpoints written before high-water marks existed load
        with none); live ranks get a fresh lease to come back in, and ranks saved as LEFT (they
        finished) are PENDING again: a job run again on its checkpoints goes on with every rank,
        awaited as at a first start (up to the join deadline), not with whoever rejoins first.
        Evicted ranks stay evicted (they rejoin with a restart). A checkpoint of another worker
        count restores the ranks both have; the caller resizes."""
        now = self.now()
        if len(saved) != len(self.members):  # the caller sets the worker count (ps_server.membership.epochs)
            self.members = [Member(rank=r) for r in range(len(saved))]
            self.num_workers = self.previous_num_workers = len(saved)
        for m, s in zip(self.members, saved, strict=True):
            m.incarnation, m.clock, m.pushes = int(s["incarnation"]), int(s["clock"]), int(s["pushes"])
            m.state = WorkerState(s["state"])
            m.counted = bool(s.get("counted", m.state is not WorkerState.EVICTED))
            if m.state is WorkerState.LEFT:
                m.state, m.counted = WorkerState.PENDING, True
            m.last_seen = now if m.state is WorkerState.LIVE else None
            m.high_water = int(s.get("high_water", -1))
            m.since = int(s.get("since", 0))
            m.until = int(s.get("until", 0))
            m.until_incarnation = int(s.get("until_incarnation", 0))
            m.restored = True
            m.session = 0
            m.history.clear()
            for inc, clock, version, staleness, duplicate, dropped, mode in s.get("history", []):
                m.history[(int(inc), int(clock))] = PushResult(
                    int(version), int(staleness), bool(duplicate), bool(dropped), str(mode)
                )
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
