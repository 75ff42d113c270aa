"""Membership and epochs glue of a shard: Join, Heartbeat, Leave, operator eviction, lease expiry,
Resize and the join deadline (:class:`ShardMembers`). Where a (re)joining rank resumes is its
policy's to say (:meth:`~ps_server.policy.base.ConsistencyPolicy.join_clock`).

Shard 0 is the membership authority (:mod:`ps_server.membership.epochs`): whether a rank counts in rounds and
waits, and how many workers the cluster has, is decided there and nowhere else; other shards adopt
its records. A shard's own lease clock only evicts on shard 0.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Callable
from typing import Any, Protocol

from ps_common.errors import InvalidRequestError, NotJoinedError, PreconditionError, WrongRankError
from ps_common.modes import ModeSettings
from ps_proto.v1 import ps_pb2
from ps_server.membership.epochs import MAX_WORKERS, Epochs
from ps_server.membership.ranks import Member, Membership, WorkerState
from ps_server.policy.base import ShardCore
from ps_server.shard import atomic_rounds
from ps_server.shard.views import JoinInfo

log = logging.getLogger(__name__)


NOT_AUTHORITY = (
    "Shard {k} follows the membership and configuration shard 0 decides; send {what} to shard 0 "
    "(ps-admin does), and every shard applies it."
)


def not_authority(shard_index: int, what: str) -> PreconditionError:
    """The refusal of a membership or configuration call made to a shard other than shard 0."""
    return PreconditionError(NOT_AUTHORITY.format(k=shard_index, what=what))


class MembersHost(ShardCore, Protocol):
    """What :class:`ShardMembers` (and :class:`~ps_server.shard.relay.MembershipRelay`) read and
    change of the shard besides what its policy does (:class:`~ps_server.policy.base.ShardCore`)."""

    refused_at: int | None

    def learning_rate(self) -> float: ...
    def apply_due(self) -> None: ...


class ShardMembers:
    """The membership of one shard: its ranks (:class:`Membership`), the membership records shard 0
    decides (:class:`Epochs`) and the worker count the shard was started with.

    Every method assumes the caller (``ps_server.shard.shard.Shard``) holds the shard's lock; none
    takes it.

    Args:
        host: the shard (read and changed as :class:`MembersHost` says).
        shard_index: this shard (shard 0 is the membership authority).
        settings: the shard's settings at start (``num_workers``: ``--num-workers``).
        lease_timeout, now, join_timeout: as :class:`Membership`.
        record_key, cluster_id: as :class:`Epochs`.
    """

    def __init__(
        self,
        host: MembersHost,
        shard_index: int,
        settings: ModeSettings,
        lease_timeout: float,
        now: Callable[[], float],
        join_timeout: float,
        record_key: str,
        cluster_id: str,
    ) -> None:
        self._host = host
        self.configured_num_workers = settings.num_workers  # --num-workers; a resize changes num_workers
        self.membership = Membership(settings.num_workers, lease_timeout, now, join_timeout)
        # shard 0 decides; records are signed with the shards' admin token (``record_key``)
        self.epochs = Epochs(
            authority=shard_index == 0, num_workers=settings.num_workers, key=record_key, cluster_id=cluster_id
        )

    def join(self, rank: int, num_workers: int, incarnation: int, epoch: int = 0) -> JoinInfo:
        """Register ``rank`` (a higher incarnation replaces the old one: its clocks start over where
        the policy says). On shard 0, a rank the cluster stopped counting (evicted, left) counts again:
        a decision (:mod:`ps_server.membership.epochs`); so is the cluster's first Join ("cluster formed": the
        record that brings the cluster's id to the other shards with the workers' joins). Another shard
        refuses such a rank until shard 0's record counts it (workers join shard 0 first). The
        cluster's count (after resizes) is in the answer's config; a worker started with the shards'
        ``--num-workers`` before a resize is welcome. Every Join draws a new session for the rank
        (:func:`check_session`); the previous one is refused from then on.

        Args:
            epoch: the membership epoch the worker knows (0: a process that never joined this cluster).
                A worker that knows one was in the cluster already: its ``num_workers`` may lag behind
                resizes it has not heard of yet, so only a fresh process's count is checked.

        Raises:
            InvalidRequestError: rank out of range, or (a fresh process) ``num_workers`` is neither the
                cluster's count nor the shards' ``--num-workers``.
            NotJoinedError: a resize left the rank out, or (not shard 0) shard 0 does not count it.
            PreconditionError: a lower incarnation than one already joined.
        """
        shard = self._host
        member = self.membership.get(rank, incarnation)
        # a rank a resize left out is told so first, whatever count it was started with (a rank
        # started for a resize that a later one undid says the count it was started for)
        self.membership.check_in_cluster(rank)
        if not epoch and num_workers not in (self.membership.num_workers, self.configured_num_workers):
            raise InvalidRequestError(
                f"This cluster has num_workers={self.membership.num_workers} but the worker says {num_workers}; "
                "start every worker and shard with the same --num-workers (after `ps-admin resize N`, "
                "workers may say N or the shards' --num-workers)."
            )
        # a sync rank whose process restarted mid-run may have pushed its last round to some shards
        # and not others: like a rank counted again, it starts at shard 0's next round everywhere
        replaced = shard.policy.holds_pushes and member.incarnation not in (0, incarnation) and not member.restored
        if not member.counted or (replaced and self.epochs.authority):
            if not self.epochs.authority:
                raise NotJoinedError(
                    f"Rank {rank} is not counted by the cluster (membership epoch {self.epochs.epoch}: "
                    f"{self.epochs.record.reason or 'evicted'}); join shard 0 first, which decides."
                )
            # counted from the next round on every shard: no shard can have closed it yet
            how = "restarted" if member.counted else "counted again"
            if member.counted:  # the old process's pushes that reached this shard count, no later one
                self.stop_counting(member)
            member.counted, member.since = True, self.next_version()
            self.decide(f"rank {rank} {how} (incarnation {incarnation}) from version {member.since}")
            shard.advance()  # the open round may no longer wait for it
        if self.epochs.authority and self.epochs.epoch == 0:
            self.decide(f"cluster {self.epochs.cluster_id} formed")
        member.restored = False
        member.session = secrets.randbits(64) or 1
        self.membership.joins.start()
        restarted = incarnation != member.incarnation
        if restarted or isinstance(shard.refusals.get(rank), atomic_rounds.CountedFromRoundError):
            shard.refusals.pop(rank, None)
        if restarted:  # a new process: its clocks start over
            member.high_water = -1
            atomic_rounds.check_replaced(shard, member)
        if restarted or member.state is not WorkerState.LIVE:
            log.info("shard %d: rank %d joined (incarnation %d)", shard.shard_index, rank, incarnation)
        member.clock = shard.policy.join_clock(shard, member, restarted)
        member.incarnation = incarnation
        member.state = WorkerState.LIVE
        self.membership.touch(member)
        shard.notify()
        return JoinInfo(
            initialized=shard.plan is not None,
            version=shard.version,
            plan_digest=shard.plan.digest if shard.plan else "",
            clock=member.clock,
            optimizer=shard.store.optimizer_spec if shard.store else None,
            session=member.session,
        )

    def session_is(self, rank: int, incarnation: int, session: int) -> bool:
        """Whether ``session`` is ``rank``'s current session here under ``incarnation`` (a data
        connection's hello; False for a rank out of range or no session)."""
        members = self.membership.members
        if not session or not 0 <= rank < len(members):
            return False
        member = members[rank]
        return member.session == session and member.incarnation == incarnation

    def is_live(self, rank: int, incarnation: int) -> bool:
        """Whether ``rank`` is joined and live here under ``incarnation`` (False for a rank out of
        range): only such a rank's Heartbeat or Leave relays a membership record."""
        members = self.membership.members
        if not 0 <= rank < len(members):
            return False
        return members[rank].state is WorkerState.LIVE and members[rank].incarnation == incarnation

    def check_session(self, rank: int, incarnation: int, session: int, what: str) -> None:
        """Refuse a push-type request (``what``: "Push", "PushRows", ...) stamped ``rank`` unless it carries
        the rank's current session here (:attr:`~ps_server.membership.ranks.Member.session`, drawn at its
        newest Join): a worker cannot push as a rank it did not join as, and a stale or confused process
        of the rank cannot overwrite its newer self's rounds. Changes nothing.

        Raises:
            InvalidRequestError: rank out of range.
            WrongRankError: ``session`` is another rank's current session here (PERMISSION_DENIED).
            NotJoinedError: no session, or not the rank's current one (this shard restarted, or the rank
                joined again since): join again (the worker's client does), then push.
        """
        shard = self._host
        member = self.membership.get(rank)
        if session and session == member.session:
            return
        owner = next((m.rank for m in self.membership.members if session and m.session == session), None)
        if owner is not None:
            raise WrongRankError(
                f"{what} stamped rank {rank} carries the session of rank {owner} on shard {shard.shard_index}; a "
                "worker pushes only as the rank it joined as. Nothing was applied."
            )
        why = "carries no session" if not session else "carries a session that is not its current one"
        raise NotJoinedError(
            f"{what} of rank {rank} incarnation {incarnation} {why} on shard {shard.shard_index} (the shard "
            "restarted, or the rank joined again since); call Join again and send JoinResponse.session with "
            "every push."
        )

    def check_member(self, rank: int, incarnation: int) -> None:
        """The checks of a Heartbeat or Leave of its own (before a record it carries is followed).

        Raises:
            InvalidRequestError: rank out of range. SupersededError: an incarnation below the joined one.
        """
        self.membership.get(rank, incarnation)

    def heartbeat(self, rank: int, incarnation: int) -> tuple[int, WorkerState]:
        """Renew ``rank``'s lease; returns (version, state)."""
        shard = self._host
        member = self.membership.get(rank, incarnation)
        if member.state is WorkerState.LIVE and member.incarnation == incarnation:
            self.membership.touch(member)
        return shard.version, member.state

    def leave(self, rank: int, incarnation: int) -> int:
        """Stop counting ``rank``; rounds and waits go on without it. Returns the version."""
        shard = self._host
        member = self.membership.get(rank, incarnation)
        if member.incarnation == incarnation and member.state is WorkerState.LIVE:
            member.state = WorkerState.LEFT
            log.info("shard %d: rank %d left", shard.shard_index, rank)
            if self.epochs.authority:
                self.stop_counting(member)
                self.decide(f"rank {rank} left")
            shard.advance()
        return shard.version

    def evict(self, rank: int) -> tuple[WorkerState, int]:
        """Operator eviction (shard 0): stop counting ``rank`` on every shard. Returns (previous
        state, version).

        Raises:
            PreconditionError: not shard 0. InvalidRequestError: rank out of range.
        """
        shard = self._host
        if not self.epochs.authority:
            raise not_authority(shard.shard_index, "EvictWorker")
        member = self.membership.get(rank)
        previous = member.state
        if previous in (WorkerState.LIVE, WorkerState.PENDING) or member.counted:
            member.state = WorkerState.EVICTED
            self.stop_counting(member)
            log.warning("shard %d: rank %d evicted by an operator", shard.shard_index, rank)
            self.decide(f"rank {rank} evicted by an operator")
            shard.advance()
        return previous, shard.version

    def stop_counting(self, member: Member) -> None:
        """Shard 0: the cluster stops counting ``member`` (evicted, left); see
        :func:`~ps_server.shard.atomic_rounds.stop_counting`. Caller holds the lock."""
        atomic_rounds.stop_counting(member, self._host.rounds, self._host.policy.holds_pushes)

    def decide(self, reason: str) -> None:
        """Shard 0: stamp the membership as it is now with the next epoch. Caller holds the lock."""
        shard = self._host
        if moved := atomic_rounds.count_from_open_round(shard, self.membership):
            reason += f"; ranks {moved} count from round {shard.rounds.round}: no other rank is counted in it"
        record = self.epochs.decide(self.membership, shard.version, reason)
        log.info("shard %d: membership epoch %d: %s", shard.shard_index, record.epoch, reason)

    def decide_change(self, change: ps_pb2.ConfigChange) -> None:
        """Shard 0: schedule ``change`` with the next epoch. Caller holds the lock."""
        shard = self._host
        reason = f"config change at version {change.version}"
        self.epochs.schedule(self.membership, shard.version, change, reason)
        log.info("shard %d: membership epoch %d: %s", shard.shard_index, self.epochs.epoch, reason)

    def adopt(self, record: ps_pb2.MembershipEpoch) -> bool:
        """Follow ``record`` (shard 0's decision, relayed by a worker) when it is newer than the
        shard's: which ranks count, the worker count, configuration changes now due. Returns whether
        it was adopted."""
        shard = self._host
        if record.epoch <= self.epochs.epoch:
            return False
        self.epochs.check(record)  # signed by shard 0, within bounds: else refused, nothing changes
        since = {m.rank: m.since for m in self.membership.members if m.counted}
        self.epochs.adopt(record, self.membership)
        self.sync_count()
        log.info("shard %d: follows membership epoch %d (%s)", shard.shard_index, record.epoch, record.reason)
        earlier = [m for m in self.membership.members if m.counted and m.since < since.get(m.rank, m.since)]
        atomic_rounds.follow(self._host, self.membership, self.epochs.record.reason, earlier)
        shard.apply_due()
        shard.advance()
        return True

    def sync_count(self) -> None:
        """The settings' worker count (told to workers in ClusterConfig) is the membership's."""
        shard = self._host
        if shard.settings.num_workers != self.membership.num_workers:
            shard.settings = dataclasses.replace(shard.settings, num_workers=self.membership.num_workers)

    def resize(self, num_workers: int, at_version: int | None = None) -> tuple[int, int]:
        """Shard 0: make ranks ``0..num_workers-1`` the cluster from version (sync: round)
        ``at_version`` on — by default the next round (this version when no rank is live). New ranks
        are waited for from there; ranks beyond push no round from there. Returns (previous count,
        the version it holds from).

        Raises:
            PreconditionError: not shard 0, or easgd (its period needs a fixed set of ranks).
            InvalidRequestError: ``num_workers`` outside 1..:data:`~ps_server.membership.epochs.MAX_WORKERS`, or
                ``at_version`` below the shard's version.
        """
        shard = self._host
        if not self.epochs.authority:
            raise not_authority(shard.shard_index, "Resize")
        if not 1 <= num_workers <= MAX_WORKERS:
            raise InvalidRequestError(f"num_workers must be from 1 to {MAX_WORKERS}, got {num_workers}.")
        if not shard.policy.resizable:
            raise PreconditionError("Resize works in sync, async, ssp and diloco; an easgd job keeps its workers.")
        at = self.next_version() if at_version is None else at_version
        if at < shard.version:
            raise InvalidRequestError(f"at_version {at} has passed: shard 0 is at version {shard.version}.")
        previous = self.membership.num_workers
        if num_workers != previous:
            self.membership.resize(num_workers, at)
            # a rank beyond the new count that never joined is not running: no round waits for it,
            # whatever count an earlier resize put in force (it joins again after a grow, counted anew)
            for m in self.membership.members[num_workers:]:
                if m.state is WorkerState.PENDING and m.counted:
                    m.state, m.counted = WorkerState.EVICTED, False
            self.sync_count()
            self.decide(f"resized from {previous} to {num_workers} workers at version {at}")
            if at <= shard.version:  # nobody is training: it holds now
                self.membership.settle(shard.version)
            shard.advance()
        return previous, at

    def next_version(self) -> int:
        """The version a change decided now takes effect at by default: the next round (no rank can
        push it anywhere before shard 0 answered this round, with the record); this version when no
        rank is live (nobody is training), or when this round was refused as a whole and waits to be
        pushed again (an operator lowering the learning rate after ``UPDATE_FAILED`` means that retry)."""
        shard = self._host
        live = any(m.state is WorkerState.LIVE for m in self.membership.members)
        return shard.version + 1 if live and shard.refused_at != shard.version else shard.version

    def restored(self, state: dict[str, Any]) -> None:
        """After a restore: the worker count. The checkpoint's (with its resizes) stands unless
        ``--num-workers`` differs from the one the checkpointed shard was started with: then the
        operator changed it, and shard 0 resizes the job to it. Caller holds the lock."""
        shard = self._host
        saved_flag = int(state.get("configured_num_workers", len(state["members"])))
        record, members = self.epochs.record, self.membership
        if record.epoch and record.num_workers:  # the checkpoint's count, resizes included
            members.num_workers = int(record.num_workers)
            members.previous_num_workers = int(record.previous_num_workers or record.num_workers)
            members.resize_version = int(record.resize_version)
            members.settle(shard.version)
        self.sync_count()
        if self.epochs.authority and self.configured_num_workers != saved_flag:
            n = self.configured_num_workers
            previous = self.membership.num_workers
            if n != previous:
                self.membership.resize(n, shard.version)
                self.membership.settle(shard.version)
                self.sync_count()
                self.decide(f"restored onto --num-workers {n} (the checkpoint has {previous})")
            log.info("shard %d: resumed onto %d workers (checkpoint: %d)", shard.shard_index, n, previous)

    def expire_leases(self) -> list[int]:
        """Evict live ranks silent for longer than the lease timeout and report ranks missing from a
        round older than the round timeout (counted ``round_timeout``); returns the evicted ranks."""
        shard = self._host
        now = shard.now()
        evicted = []
        # only shard 0 evicts: other shards keep leases for their status, and follow its decisions
        for rank, silent in self.membership.expire() if self.epochs.authority else ():
            evicted.append(rank)
            self.stop_counting(self.membership.members[rank])
            log.warning("shard %d: rank %d evicted after %.1f s without a heartbeat", shard.shard_index, rank, silent)
            self.decide(f"rank {rank} evicted after {silent:.1f} s without a heartbeat")
        timeout = shard.settings.round_timeout
        if timeout and shard.round_opened is not None and not shard.round_reported:
            if now - shard.round_opened > timeout:
                shard.round_reported = True
                shard.counters.refuse("round_timeout")
                log.warning(
                    "shard %d: round %d open for %.1f s, waiting for ranks %s",
                    shard.shard_index,
                    shard.rounds.round,
                    now - shard.round_opened,
                    shard.rounds.waiting_for(self.membership.counted_in(shard.rounds.round)),
                )
        if evicted:
            shard.advance()
        return evicted

    def report_missing(self) -> list[int]:
        """Ranks that never joined within the join timeout; the first time there are some, log them
        and count ``join_timeout`` (called by the reaper and by waits)."""
        shard = self._host
        joins = self.membership.joins
        missing = joins.missing(self.membership.members)
        if missing and not joins.reported:
            joins.reported = True
            shard.counters.refuse("join_timeout")
            log.error("shard %d: %s", shard.shard_index, joins.describe(missing, shard.shard_index))
        return missing
