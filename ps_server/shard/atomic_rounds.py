"""Sync rounds atomic across shards: every shard closes a round with the same ranks
(docs/faults.md#rounds-atomic-across-shards).

A rank can stop after its push of round ``r`` reached some shards and not others. When shard 0
stops counting it (lease lapsed, eviction, Leave, a new process joining as the rank), it decides
``until``: the rank's pushes count in the rounds below it, on every shard, and in none from it on
(until the rank rejoins). ``until`` is shard 0's open round, plus one when shard 0 holds the
rank's push of it: a push that reached shard 0 counts, one that did not counts nowhere. The other
shards follow the record: they wait for the rank's pushes below ``until`` (a paused rank delivers
them when it resumes) and drop a held push of a later round. A round a shard cannot close as shard 0
did (it closed it with a push shard 0 never took, or waits for one whose process is gone: a new one
joined as the rank) is *lost*: the shard says so and takes no push from then on, rather than fork
the model silently. A rank that never comes back is waited for as any rank that does not push: the
waiting workers give up after their ``wait_timeout`` with AwaitingRanks naming it.

Functions over the shard's members and rounds; each caller holds the shard's lock.
"""

from __future__ import annotations

import logging

from ps_common.errors import NotJoinedError
from ps_server.membership.ranks import Member, Membership
from ps_server.policy.base import ShardCore
from ps_server.policy.rounds import SyncRounds

log = logging.getLogger(__name__)


class CountedFromRoundError(NotJoinedError):
    """NOT_JOINED, told to a rank counted from an earlier round than it joined at
    (:func:`count_from_open_round`): its next Join answers it (a Join takes it back; other
    NOT_JOINED refusals stay for the call they were meant for)."""


def stop_counting(member: Member, rounds: SyncRounds, sync: bool) -> None:
    """Shard 0: the cluster stops counting ``member``; with ``sync`` rounds, its pushes count in the
    rounds below ``member.until``: shard 0's open round, plus one when ``rounds`` holds its push."""
    member.counted = False
    if sync and member.since <= rounds.round:
        member.until = rounds.round + (member.rank in rounds.pending)
        member.until_incarnation = member.incarnation


def count_from_open_round(host: ShardCore, membership: Membership) -> list[int]:
    """Shard 0, deciding: when no rank counts in the open round ``R`` any more (its ranks left or
    stopped) while some are counted from a later round (they joined while ``R`` still had a rank to
    push it), nobody would ever push ``R`` and they would wait for version ``R + 1`` for ever. They
    count from ``R`` instead: no shard can have closed it (it holds no push), and its result is the
    one they wait for. Their waiting calls are told NOT_JOINED (:func:`tell_counted_from`). Returns
    their ranks."""
    rounds = host.rounds
    if not host.policy.holds_pushes or rounds.pending or membership.counted_in(rounds.round):
        return []
    moved = [m for m in membership.members if m.counted and m.since > rounds.round]
    for m in moved:
        m.since = rounds.round
    tell_counted_from(host, moved)
    return [m.rank for m in moved]


def tell_counted_from(host: ShardCore, members: list[Member]) -> None:
    """``members`` count from an earlier round than they joined at (:func:`count_from_open_round`):
    a call of theirs waiting for a later version is told NOT_JOINED; joining again, each is told the
    round it counts from and pulls its result (a Join takes the refusal back)."""
    for m in members:
        if m.rank not in host.rounds.pending:
            host.refusals[m.rank] = CountedFromRoundError(  # type: ignore[assignment]
                f"Rank {m.rank} counts from round {m.since} now: no other rank is counted in round {m.since} any "
                f"more (they left or stopped); join again, then pull version {m.since}."
            )


def follow(host: ShardCore, membership: Membership, reason: str, earlier: list[Member]) -> None:
    """A follower, after adopting shard 0's record (``reason``: its words; ``earlier``: ranks it
    counts from an earlier round than before): drop the open round's held push of a rank the record
    does not count in it (the rank's waiting call is told NOT_JOINED), lose the round when a closed
    round took a push the record does not count, and tell ``earlier`` (:func:`tell_counted_from`)."""
    if not host.policy.holds_pushes or host.lost_round:
        return
    tell_counted_from(host, earlier)
    rounds = host.rounds
    expected = set(membership.counted_in(rounds.round))
    for m in membership.members:
        if m.rank in rounds.pending and m.rank not in expected:
            rounds.drop(m.rank)
            m.history.pop((m.incarnation, rounds.round), None)
            m.clock = min(m.clock, rounds.round)
            host.refusals[m.rank] = NotJoinedError(  # type: ignore[assignment]
                f"Rank {m.rank}'s push of round {rounds.round} is not counted: it had not reached shard 0 when "
                f"shard 0 stopped counting the rank ({reason}); join again, then pull."
            )
            log.info("shard %d: rank %d's push of round %d dropped", host.shard_index, m.rank, rounds.round)
        closed = [
            c
            for (inc, c), r in m.history.items()
            if inc == m.incarnation == m.until_incarnation  # shard 0 decided about this process's pushes
            and c < rounds.round
            and not r.dropped
            and m.rank < membership.size(c)
            and not (c < m.until or (m.counted and m.since <= c))
        ]
        if closed:
            why = f"it took rank {m.rank}'s push of it, which never reached shard 0 before shard 0 stopped counting it"
            lose(host, min(closed), why)
        elif m.incarnation > m.until_incarnation:  # a new process joined here before the record came
            check_replaced(host, m)


def check_replaced(host: ShardCore, member: Member) -> None:
    """A new process joined as ``member``'s rank (or has joined, before shard 0's record came): a
    round below its ``until`` still waiting for the old process's push here is lost (shard 0 took
    that push; no process can bring it now)."""
    rounds = host.rounds
    if host.policy.holds_pushes and rounds.round < member.until and member.rank not in rounds.pending:
        why = (
            f"shard 0 took rank {member.rank}'s push of it, which never reached this shard, and the process "
            "that made it is gone (a new one joined as the rank)"
        )
        lose(host, rounds.round, why)


def lose(host: ShardCore, round_: int, why: str) -> None:
    """Round ``round_`` cannot close here with the ranks shard 0 closed it with: every push and
    every read that needs it is refused from now on (FAILED_PRECONDITION, ``host.lost_round``)."""
    host.lost_round = (
        f"Shard {host.shard_index} cannot close round {round_} with the ranks shard 0 closed it with: {why}. "
        "The shards' models would differ from here, so this shard takes no push; restart the job from its "
        "newest checkpoints (the shards' --checkpoint-dir; ps-launch --log-dir)."
    )
    host.counters.refuse("lost_round")
    log.error("shard %d: %s", host.shard_index, host.lost_round)
    host.notify()
