"""The state of one shard: membership, versions, idempotent pushes and waits, under one condition.

The servicer decodes a request and calls one method here; each method validates everything before
it touches state, so a refused request changes nothing. Policies (``ps_server.policy``) decide
when gradients apply; the store applies them.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ps_server.core.errors import (
    InvalidRequestError,
    NotInitializedError,
    PlanMismatchError,
    PreconditionError,
    ShuttingDownError,
    WaitTimeoutError,
)
from ps_server.core.optimizer import OptimizerSpec
from ps_server.core.partitions import WirePartition, match_partitions
from ps_server.core.plan import ParameterSpec, PartitionSlice, Plan, make_plan
from ps_server.policy.sync import SyncRounds
from ps_server.store import ParameterStore

log = logging.getLogger(__name__)

MODES = ("async", "easgd", "ssp", "sync")
PUSH_HISTORY = 64
"""Answers remembered per rank for duplicate pushes (retries resend the same clock)."""


class WorkerState(enum.Enum):
    PENDING = "pending"
    LIVE = "live"
    EVICTED = "evicted"
    LEFT = "left"


@dataclass(frozen=True)
class PushResult:
    """Answer to a push: the version it was accepted at and its staleness in versions."""

    version: int
    staleness: int = 0
    duplicate: bool = False


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


@dataclass(frozen=True)
class JoinInfo:
    initialized: bool
    version: int
    plan_digest: str
    clock: int


@dataclass(frozen=True)
class MemberView:
    rank: int
    incarnation: int
    clock: int
    state: WorkerState
    last_seen_seconds_ago: float
    pushes: int


@dataclass(frozen=True)
class StatusView:
    """A consistent snapshot of a shard for Admin/GetStatus."""

    shard_index: int
    num_shards: int
    mode: str
    num_workers: int
    lease_timeout: float
    initialized: bool
    version: int
    plan_digest: str
    num_partitions: int
    num_elements: int
    parameter_bytes: int
    optimizer: OptimizerSpec | None
    workers: tuple[MemberView, ...]
    round_ranks: tuple[int, ...]


class Shard:
    """Thread-safe state of shard ``shard_index`` of ``num_shards``.

    Args:
        shard_index: this shard, ``0 <= shard_index < num_shards``.
        num_shards: shards in the cluster.
        num_workers: ranks in the cluster.
        mode: consistency model, one of :data:`MODES`.
        lease_timeout: seconds of silence after which a live rank is evicted.
        now: monotonic clock in seconds (injected for tests).
    """

    def __init__(
        self,
        shard_index: int,
        num_shards: int,
        num_workers: int,
        mode: str = "sync",
        lease_timeout: float = 10.0,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in MODES:
            raise InvalidRequestError(f"Unknown mode {mode!r}; expected one of {', '.join(MODES)}.")
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.num_workers = num_workers
        self.mode = mode
        self.lease_timeout = lease_timeout
        self._now = now
        self._cond = threading.Condition()
        self._closed = False
        self.plan: Plan | None = None
        self.store: ParameterStore | None = None
        self.version = 0
        self.rounds = SyncRounds()
        self.members = [Member(rank=r) for r in range(num_workers)]

    # ----------------------------------------------------------------- validation helpers
    def _check_rank(self, rank: int, incarnation: int | None = None) -> Member:
        if not 0 <= rank < self.num_workers:
            raise InvalidRequestError(
                f"Rank {rank} is out of range: this cluster has num_workers={self.num_workers} "
                f"(ranks 0..{self.num_workers - 1})."
            )
        member = self.members[rank]
        if incarnation is not None and incarnation < member.incarnation:
            raise PreconditionError(
                f"Rank {rank} incarnation {incarnation} was superseded by incarnation "
                f"{member.incarnation}; this process is stale and should exit."
            )
        return member

    def _check_live(self, member: Member, incarnation: int) -> None:
        if member.state is not WorkerState.LIVE or incarnation != member.incarnation:
            raise PreconditionError(
                f"Rank {member.rank} incarnation {incarnation} is not joined here "
                f"(state {member.state.value}); call Join again, then pull."
            )

    def _check_plan(self, digest: str) -> Plan:
        if self.plan is None:
            raise NotInitializedError(
                f"Shard {self.shard_index} is not initialized; rank 0 must call Init before pushes and pulls."
            )
        if digest and digest != self.plan.digest:
            raise PlanMismatchError(
                f"Plan digest {digest[:12]} does not match this shard's {self.plan.digest[:12]}; "
                "every worker must build the same model with the same num_shards and partition_bytes."
            )
        return self.plan

    def _expected(self) -> list[int]:
        """Ranks a sync round waits for: joined and live, or not joined yet."""
        return [m.rank for m in self.members if m.state in (WorkerState.PENDING, WorkerState.LIVE)]

    def _touch(self, member: Member) -> None:
        member.last_seen = self._now()

    # ----------------------------------------------------------------- membership
    def join(self, rank: int, num_workers: int, incarnation: int) -> JoinInfo:
        """Register ``rank`` (a higher incarnation replaces the old one).

        Raises:
            InvalidRequestError: rank out of range or num_workers differs from the cluster's.
            PreconditionError: a lower incarnation than one already joined.
        """
        if num_workers != self.num_workers:
            raise InvalidRequestError(
                f"This cluster has num_workers={self.num_workers} but the worker says {num_workers}; "
                "start every worker and shard with the same --num-workers."
            )
        with self._cond:
            member = self._check_rank(rank, incarnation)
            if incarnation > member.incarnation or member.state is not WorkerState.LIVE:
                log.info("shard %d: rank %d joined (incarnation %d)", self.shard_index, rank, incarnation)
            member.incarnation = incarnation
            member.state = WorkerState.LIVE
            self._touch(member)
            if self.mode == "sync":
                member.clock = self.rounds.round
            self._cond.notify_all()
            return JoinInfo(
                initialized=self.plan is not None,
                version=self.version,
                plan_digest=self.plan.digest if self.plan else "",
                clock=member.clock,
            )

    def heartbeat(self, rank: int, incarnation: int) -> tuple[int, WorkerState]:
        """Renew ``rank``'s lease; returns (version, state)."""
        with self._cond:
            member = self._check_rank(rank, incarnation)
            if member.state is WorkerState.LIVE and member.incarnation == incarnation:
                self._touch(member)
            return self.version, member.state

    def leave(self, rank: int, incarnation: int) -> int:
        """Stop counting ``rank``; rounds and waits go on without it. Returns the version."""
        with self._cond:
            member = self._check_rank(rank, incarnation)
            if member.incarnation == incarnation and member.state is WorkerState.LIVE:
                member.state = WorkerState.LEFT
                log.info("shard %d: rank %d left", self.shard_index, rank)
                self._advance()
            return self.version

    def expire_leases(self) -> list[int]:
        """Evict live ranks silent for longer than the lease timeout; returns the evicted ranks."""
        with self._cond:
            now = self._now()
            evicted = []
            for m in self.members:
                if m.state is WorkerState.LIVE and m.last_seen is not None and now - m.last_seen > self.lease_timeout:
                    m.state = WorkerState.EVICTED
                    evicted.append(m.rank)
                    log.warning(
                        "shard %d: rank %d evicted after %.1f s without a heartbeat",
                        self.shard_index,
                        m.rank,
                        now - m.last_seen,
                    )
            if evicted:
                self._advance()
            return evicted

    # ----------------------------------------------------------------- init
    def init(
        self,
        specs: Sequence[ParameterSpec],
        num_shards: int,
        partition_bytes: int,
        digest: str,
        optimizer: OptimizerSpec,
        partitions: Sequence[WirePartition],
    ) -> tuple[bool, int, str]:
        """First writer wins: set the plan, initial values and optimizer.

        Returns:
            (applied, version, plan digest). ``applied`` is False when already initialized with
            the same plan (a no-op).

        Raises:
            InvalidRequestError: num_shards differs, digest does not match the specs, a bad
                partition or optimizer spec.
            PlanMismatchError: already initialized with another plan.
        """
        if num_shards != self.num_shards:
            raise InvalidRequestError(
                f"Init is for {num_shards} shards but this cluster has {self.num_shards}; "
                "pass every shard's address to the client."
            )
        plan = make_plan(specs, num_shards, partition_bytes)
        if digest != plan.digest:
            raise InvalidRequestError(
                f"Init's plan digest {digest[:12]} does not match its own specs ({plan.digest[:12]}); "
                "the client and server disagree on the plan algorithm: upgrade both to the same release."
            )
        with self._cond:
            if self.plan is not None:
                self._check_plan(digest)
                return False, self.version, self.plan.digest
        values = match_partitions(plan, self.shard_index, partitions, "value")
        store = ParameterStore(plan, self.shard_index, values, optimizer)
        with self._cond:
            if self.plan is not None:  # lost a race with another Init
                self._check_plan(digest)
                return False, self.version, self.plan.digest
            self.plan, self.store = plan, store
            log.info(
                "shard %d: initialized with %d partitions (%d bytes), plan %s, optimizer %s",
                self.shard_index,
                len(store.partitions),
                store.num_bytes,
                plan.digest[:12],
                optimizer.name,
            )
            self._cond.notify_all()
            return True, self.version, plan.digest

    # ----------------------------------------------------------------- push / pull
    def push(
        self,
        rank: int,
        incarnation: int,
        clock: int,
        grad_version: int,
        digest: str,
        partitions: Sequence[WirePartition],
    ) -> PushResult:
        """Accept ``rank``'s gradients for ``clock``; a repeated (rank, incarnation, clock) is
        answered with the original result and applied once.

        Raises:
            InvalidRequestError: bad rank or partitions. NotInitializedError, PlanMismatchError,
            PreconditionError: not initialized, other plan, not joined. StalePushError: round closed.
        """
        with self._cond:
            plan = self._check_plan(digest)
            member = self._check_rank(rank, incarnation)
            seen = member.history.get((incarnation, clock))
            if seen is not None:
                return PushResult(seen.version, seen.staleness, duplicate=True)
            self._check_live(member, incarnation)
        grads = match_partitions(plan, self.shard_index, partitions, "gradient")
        with self._cond:
            self._check_live(member, incarnation)
            seen = member.history.get((incarnation, clock))
            if seen is not None:
                return PushResult(seen.version, seen.staleness, duplicate=True)
            self.rounds.add(rank, clock, grads)
            result = PushResult(version=self.version, staleness=0)
            member.clock = clock + 1
            member.pushes += 1
            member.history[(incarnation, clock)] = result
            while len(member.history) > PUSH_HISTORY:
                member.history.popitem(last=False)
            self._touch(member)
            self._advance()
            return result

    def _advance(self) -> None:
        """Close the sync round if it is complete; wake waiters. Caller holds the lock."""
        if self.mode == "sync" and self.store is not None:
            mean = self.rounds.close_if_complete(self._expected())
            if mean is not None:
                self.store.apply(mean)
                self.version = self.rounds.round
                log.debug("shard %d: round %d applied", self.shard_index, self.version - 1)
        self._cond.notify_all()

    def pull(
        self, rank: int, incarnation: int, min_version: int, digest: str, timeout: float | None
    ) -> tuple[int, list[tuple[PartitionSlice, bytes]]]:
        """Wait until the version is at least ``min_version``, then copy out every partition.

        Args:
            timeout: seconds to wait at most; None waits until the shard closes.

        Returns:
            (version, [(partition, raw bytes)]) in plan order, from one consistent snapshot.

        Raises:
            WaitTimeoutError: ``min_version`` not reached in time. ShuttingDownError: closing.
            NotInitializedError, PlanMismatchError, InvalidRequestError, PreconditionError.
        """
        deadline = None if timeout is None else self._now() + timeout
        with self._cond:
            self._check_plan(digest)
            member = self._check_rank(rank, incarnation)
            if member.state is WorkerState.LIVE and member.incarnation == incarnation:
                self._touch(member)
            while self.version < min_version:
                if self._closed:
                    raise ShuttingDownError(f"Shard {self.shard_index} is shutting down; retry against its restart.")
                remaining = None if deadline is None else deadline - self._now()
                if remaining is not None and remaining <= 0:
                    waiting = self.rounds.waiting_for(self._expected())
                    raise WaitTimeoutError(
                        f"Version {min_version} not reached in {timeout:.1f} s (shard {self.shard_index} is at "
                        f"{self.version}; round waits for ranks {waiting}); check those workers."
                    )
                self._cond.wait(remaining)
            assert self.store is not None
            return self.version, list(zip(self.store.partitions, self.store.snapshot(), strict=True))

    # ----------------------------------------------------------------- admin
    def status(self) -> StatusView:
        """A consistent snapshot for operators."""
        with self._cond:
            now = self._now()
            return StatusView(
                shard_index=self.shard_index,
                num_shards=self.num_shards,
                mode=self.mode,
                num_workers=self.num_workers,
                lease_timeout=self.lease_timeout,
                initialized=self.plan is not None,
                version=self.version,
                plan_digest=self.plan.digest if self.plan else "",
                num_partitions=len(self.store.partitions) if self.store else 0,
                num_elements=self.store.num_elements if self.store else 0,
                parameter_bytes=self.store.num_bytes if self.store else 0,
                optimizer=self.store.optimizer_spec if self.store else None,
                workers=tuple(
                    MemberView(
                        rank=m.rank,
                        incarnation=m.incarnation,
                        clock=m.clock,
                        state=m.state,
                        last_seen_seconds_ago=-1.0 if m.last_seen is None else now - m.last_seen,
                        pushes=m.pushes,
                    )
                    for m in self.members
                ),
                round_ranks=tuple(sorted(self.rounds.pending)),
            )

    def close(self) -> None:
        """Wake every waiter with ShuttingDownError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
