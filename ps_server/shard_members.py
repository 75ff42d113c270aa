"""The membership calls of a :class:`~ps_server.shard.Shard`: Join, Heartbeat, Leave, operator
eviction, lease expiry and the join deadline, each under the shard's lock. Where a (re)joining rank
resumes is its policy's to say (:meth:`~ps_server.policy.base.ConsistencyPolicy.join_clock`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ps_common.errors import InvalidRequestError
from ps_server.membership import WorkerState
from ps_server.shard_views import JoinInfo

if TYPE_CHECKING:
    from ps_server.shard import Shard

log = logging.getLogger("ps_server.shard")


def join(shard: Shard, rank: int, num_workers: int, incarnation: int) -> JoinInfo:
    """Register ``rank`` (a higher incarnation replaces the old one: its clocks start over where
    the policy says).

    Raises:
        InvalidRequestError: rank out of range or num_workers differs from the cluster's.
        PreconditionError: a lower incarnation than one already joined.
    """
    if num_workers != shard.num_workers:
        raise InvalidRequestError(
            f"This cluster has num_workers={shard.num_workers} but the worker says {num_workers}; "
            "start every worker and shard with the same --num-workers."
        )
    with shard._cond:
        member = shard.membership.get(rank, incarnation)
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
        )


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
            shard.advance()
        return shard.version


def evict(shard: Shard, rank: int) -> tuple[WorkerState, int]:
    """Operator eviction: stop counting ``rank`` now. Returns (previous state, version)."""
    with shard._cond:
        member = shard.membership.get(rank)
        previous = member.state
        if previous in (WorkerState.LIVE, WorkerState.PENDING):
            member.state = WorkerState.EVICTED
            log.warning("shard %d: rank %d evicted by an operator", shard.shard_index, rank)
            shard.advance()
        return previous, shard.version


def expire_leases(shard: Shard) -> list[int]:
    """Evict live ranks silent for longer than the lease timeout and report ranks missing from a
    round older than the round timeout (counted ``round_timeout``); returns the evicted ranks."""
    with shard._cond:
        now = shard.now()
        evicted = []
        for rank, silent in shard.membership.expire():
            evicted.append(rank)
            log.warning("shard %d: rank %d evicted after %.1f s without a heartbeat", shard.shard_index, rank, silent)
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
                    shard.rounds.waiting_for(shard.membership.expected()),
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
