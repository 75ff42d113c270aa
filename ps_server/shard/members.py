"""The membership calls of a :class:`~ps_server.shard.shard.Shard`: Join, Heartbeat, Leave, operator
eviction, lease expiry, Resize and the join deadline, each under the shard's lock. Where a
(re)joining rank resumes is its policy's to say
(:meth:`~ps_server.policy.base.ConsistencyPolicy.join_clock`).

Shard 0 is the membership authority (:mod:`ps_server.membership.epochs`): whether a rank counts in rounds and
waits, and how many workers the cluster has, is decided there and nowhere else; other shards adopt
its records. A shard's own lease clock only evicts on shard 0.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from typing import TYPE_CHECKING, Any

from ps_common.errors import InvalidRequestError, NotJoinedError, PreconditionError, WrongRankError
from ps_proto.v1 import ps_pb2
from ps_server.membership.epochs import MAX_WORKERS
from ps_server.membership.ranks import WorkerState
from ps_server.shard import admin as shard_admin
from ps_server.shard.views import JoinInfo

if TYPE_CHECKING:
    from ps_server.shard.shard import Shard

log = logging.getLogger("ps_server.shard.shard")


NOT_AUTHORITY = (
    "Shard {k} follows the membership and configuration shard 0 decides; send {what} to shard 0 "
    "(ps-admin does), and every shard applies it."
)


def not_authority(shard: Shard, what: str) -> PreconditionError:
    """The refusal of a membership or configuration call made to a shard other than shard 0."""
    return PreconditionError(NOT_AUTHORITY.format(k=shard.shard_index, what=what))


def join(shard: Shard, rank: int, num_workers: int, incarnation: int, epoch: int = 0) -> JoinInfo:
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
    with shard._cond:
        member = shard.membership.get(rank, incarnation)
        # a rank a resize left out is told so first, whatever count it was started with (a rank
        # started for a resize that a later one undid says the count it was started for)
        shard.membership.check_in_cluster(rank)
        if not epoch and num_workers not in (shard.num_workers, shard.configured_num_workers):
            raise InvalidRequestError(
                f"This cluster has num_workers={shard.num_workers} but the worker says {num_workers}; "
                "start every worker and shard with the same --num-workers (after `ps-admin resize N`, "
                "workers may say N or the shards' --num-workers)."
            )
        # a sync rank whose process restarted mid-run may have pushed its last round to some shards
        # and not others: like a rank counted again, it starts at shard 0's next round everywhere
        replaced = shard.policy.holds_pushes and member.incarnation not in (0, incarnation) and not member.restored
        if not member.counted or (replaced and shard.epochs.authority):
            if not shard.epochs.authority:
                raise NotJoinedError(
                    f"Rank {rank} is not counted by the cluster (membership epoch {shard.epochs.epoch}: "
                    f"{shard.epochs.record.reason or 'evicted'}); join shard 0 first, which decides."
                )
            # counted from the next round on every shard: no shard can have closed it yet
            how = "restarted" if member.counted else "counted again"
            member.counted, member.since = True, next_version(shard)
            decide(shard, f"rank {rank} {how} (incarnation {incarnation}) from version {member.since}")
            shard.advance()  # the open round may no longer wait for it
        if shard.epochs.authority and shard.epochs.epoch == 0:
            decide(shard, f"cluster {shard.epochs.cluster_id} formed")
        member.restored = False
        member.session = secrets.randbits(64) or 1
        shard.membership.joins.start()
        restarted = incarnation != member.incarnation
        if restarted:  # a new process: its clocks start over
            member.high_water = -1
            shard.refusals.pop(rank, None)
        if restarted or member.state is not WorkerState.LIVE:
            log.info("shard %d: rank %d joined (incarnation %d)", shard.shard_index, rank, incarnation)
        member.clock = shard.policy.join_clock(shard, member, restarted)
        member.incarnation = incarnation
        member.state = WorkerState.LIVE
        shard.membership.touch(member)
        shard._cond.notify_all()
        return JoinInfo(
            initialized=shard.plan is not None,
            version=shard.version,
            plan_digest=shard.plan.digest if shard.plan else "",
            clock=member.clock,
            optimizer=shard.store.optimizer_spec if shard.store else None,
            session=member.session,
        )


def check_session(shard: Shard, rank: int, incarnation: int, session: int, what: str) -> None:
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
    with shard._cond:
        member = shard.membership.get(rank)
        if session and session == member.session:
            return
        owner = next((m.rank for m in shard.members if session and m.session == session), None)
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


def check_member(shard: Shard, rank: int, incarnation: int) -> None:
    """The checks of a Heartbeat or Leave of its own (before a record it carries is followed).

    Raises:
        InvalidRequestError: rank out of range. SupersededError: an incarnation below the joined one.
    """
    with shard._cond:
        shard.membership.get(rank, incarnation)


def heartbeat(shard: Shard, rank: int, incarnation: int) -> tuple[int, WorkerState]:
    """Renew ``rank``'s lease; returns (version, state)."""
    with shard._cond:
        member = shard.membership.get(rank, incarnation)
        if member.state is WorkerState.LIVE and member.incarnation == incarnation:
            shard.membership.touch(member)
        return shard.version, member.state


def leave(shard: Shard, rank: int, incarnation: int) -> int:
    """Stop counting ``rank``; rounds and waits go on without it. Returns the version."""
    with shard._cond:
        member = shard.membership.get(rank, incarnation)
        if member.incarnation == incarnation and member.state is WorkerState.LIVE:
            member.state = WorkerState.LEFT
            log.info("shard %d: rank %d left", shard.shard_index, rank)
            if shard.epochs.authority:
                member.counted = False
                decide(shard, f"rank {rank} left")
            shard.advance()
        return shard.version


def evict(shard: Shard, rank: int) -> tuple[WorkerState, int]:
    """Operator eviction (shard 0): stop counting ``rank`` on every shard. Returns (previous
    state, version).

    Raises:
        PreconditionError: not shard 0. InvalidRequestError: rank out of range.
    """
    with shard._cond:
        if not shard.epochs.authority:
            raise not_authority(shard, "EvictWorker")
        member = shard.membership.get(rank)
        previous = member.state
        if previous in (WorkerState.LIVE, WorkerState.PENDING) or member.counted:
            member.state, member.counted = WorkerState.EVICTED, False
            log.warning("shard %d: rank %d evicted by an operator", shard.shard_index, rank)
            decide(shard, f"rank {rank} evicted by an operator")
            shard.advance()
        return previous, shard.version


def decide(shard: Shard, reason: str) -> None:
    """Shard 0: stamp the membership as it is now with the next epoch. Caller holds the lock."""
    record = shard.epochs.decide(shard.membership, shard.version, reason)
    log.info("shard %d: membership epoch %d: %s", shard.shard_index, record.epoch, reason)


def decide_change(shard: Shard, change: ps_pb2.ConfigChange) -> None:
    """Shard 0: schedule ``change`` with the next epoch. Caller holds the lock."""
    reason = f"config change at version {change.version}"
    shard.epochs.schedule(shard.membership, shard.version, change, reason)
    log.info("shard %d: membership epoch %d: %s", shard.shard_index, shard.epochs.epoch, reason)


def adopt(shard: Shard, record: ps_pb2.MembershipEpoch) -> bool:
    """Follow ``record`` (shard 0's decision, relayed by a worker) when it is newer than the
    shard's: which ranks count, the worker count, configuration changes now due. Returns whether
    it was adopted."""
    with shard._cond:
        if record.epoch <= shard.epochs.epoch:
            return False
        shard.epochs.check(record)  # signed by shard 0, within bounds: else refused, nothing changes
        shard.epochs.adopt(record, shard.membership)
        _sync_count(shard)
        log.info("shard %d: follows membership epoch %d (%s)", shard.shard_index, record.epoch, record.reason)
        shard_admin.apply_due(shard)
        shard.advance()
        return True


def _sync_count(shard: Shard) -> None:
    """The settings' worker count (told to workers in ClusterConfig) is the membership's."""
    if shard.settings.num_workers != shard.membership.num_workers:
        shard.settings = dataclasses.replace(shard.settings, num_workers=shard.membership.num_workers)


def resize(shard: Shard, num_workers: int, at_version: int | None = None) -> tuple[int, int]:
    """Shard 0: make ranks ``0..num_workers-1`` the cluster from version (sync: round)
    ``at_version`` on — by default the next round (this version when no rank is live). New ranks
    are waited for from there; ranks beyond push no round from there. Returns (previous count,
    the version it holds from).

    Raises:
        PreconditionError: not shard 0, or easgd (its period needs a fixed set of ranks).
        InvalidRequestError: ``num_workers`` outside 1..:data:`~ps_server.membership.epochs.MAX_WORKERS`, or
            ``at_version`` below the shard's version.
    """
    with shard._cond:
        if not shard.epochs.authority:
            raise not_authority(shard, "Resize")
        if not 1 <= num_workers <= MAX_WORKERS:
            raise InvalidRequestError(f"num_workers must be from 1 to {MAX_WORKERS}, got {num_workers}.")
        if not shard.policy.resizable:
            raise PreconditionError("Resize works in sync, async and ssp; an easgd job keeps its workers.")
        at = next_version(shard) if at_version is None else at_version
        if at < shard.version:
            raise InvalidRequestError(f"at_version {at} has passed: shard 0 is at version {shard.version}.")
        previous = shard.membership.num_workers
        if num_workers != previous:
            shard.membership.resize(num_workers, at)
            # a rank beyond the new count that never joined is not running: no round waits for it,
            # whatever count an earlier resize put in force (it joins again after a grow, counted anew)
            for m in shard.members[num_workers:]:
                if m.state is WorkerState.PENDING and m.counted:
                    m.state, m.counted = WorkerState.EVICTED, False
            _sync_count(shard)
            decide(shard, f"resized from {previous} to {num_workers} workers at version {at}")
            if at <= shard.version:  # nobody is training: it holds now
                shard.membership.settle(shard.version)
            shard.advance()
        return previous, at


def next_version(shard: Shard) -> int:
    """The version a change decided now takes effect at by default: the next round (no rank can
    push it anywhere before shard 0 answered this round, with the record); this version when no
    rank is live (nobody is training), or when this round was refused as a whole and waits to be
    pushed again (an operator lowering the learning rate after ``UPDATE_FAILED`` means that retry)."""
    live = any(m.state is WorkerState.LIVE for m in shard.members)
    return shard.version + 1 if live and shard.refused_at != shard.version else shard.version


def restored(shard: Shard, state: dict[str, Any]) -> None:
    """After a restore: the worker count. The checkpoint's (with its resizes) stands unless
    ``--num-workers`` differs from the one the checkpointed shard was started with: then the
    operator changed it, and shard 0 resizes the job to it. Caller holds the lock."""
    saved_flag = int(state.get("configured_num_workers", len(state["members"])))
    record, members = shard.epochs.record, shard.membership
    if record.epoch and record.num_workers:  # the checkpoint's count, resizes included
        members.num_workers = int(record.num_workers)
        members.previous_num_workers = int(record.previous_num_workers or record.num_workers)
        members.resize_version = int(record.resize_version)
        members.settle(shard.version)
    _sync_count(shard)
    if shard.epochs.authority and shard.configured_num_workers != saved_flag:
        n = shard.configured_num_workers
        previous = shard.membership.num_workers
        if n != previous:
            shard.membership.resize(n, shard.version)
            shard.membership.settle(shard.version)
            _sync_count(shard)
            decide(shard, f"restored onto --num-workers {n} (the checkpoint has {previous})")
        log.info("shard %d: resumed onto %d workers (checkpoint: %d)", shard.shard_index, n, previous)


def expire_leases(shard: Shard) -> list[int]:
    """Evict live ranks silent for longer than the lease timeout and report ranks missing from a
    round older than the round timeout (counted ``round_timeout``); returns the evicted ranks."""
    with shard._cond:
        now = shard.now()
        evicted = []
        # only shard 0 evicts: other shards keep leases for their status, and follow its decisions
        for rank, silent in shard.membership.expire() if shard.epochs.authority else ():
            evicted.append(rank)
            shard.members[rank].counted = False
            log.warning("shard %d: rank %d evicted after %.1f s without a heartbeat", shard.shard_index, rank, silent)
            decide(shard, f"rank {rank} evicted after {silent:.1f} s without a heartbeat")
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
                    shard.rounds.waiting_for(shard.membership.expected(shard.rounds.round)),
                )
        if evicted:
            shard.advance()
        return evicted


def report_missing(shard: Shard) -> list[int]:
    """Ranks that never joined within the join timeout; the first time there are some, log them
    and count ``join_timeout`` (called by the reaper and by waits)."""
    with shard._cond:
        joins = shard.membership.joins
        missing = joins.missing(shard.members)
        if missing and not joins.reported:
            joins.reported = True
            shard.counters.refuse("join_timeout")
            log.error("shard %d: %s", shard.shard_index, joins.describe(missing, shard.shard_index))
        return missing
