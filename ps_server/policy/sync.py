"""Synchronous (BSP) rounds: one gradient per live rank per round, summed in rank order.

Round ``t`` collects the pushes with clock ``t``. When every expected rank has pushed, the
gradients are summed **in rank order** (never arrival order), divided by their count, and handed
back for one optimizer step; the version becomes ``t + 1``. Because the order of floating-point
additions is fixed, the result is bitwise identical whatever the arrival timing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import torch

from ps_common.errors import (
    FutureRoundError,
    HyperparametersDisagreeError,
    PreconditionError,
    PushLostError,
    StalePushError,
    UpdateRefusedError,
    VersionAheadError,
)
from ps_common.modes import ModeSettings
from ps_server.core.partitions import Bounded, max_abs_of
from ps_server.membership.ranks import Member, PushResult, PushStamp
from ps_server.policy.base import ConsistencyPolicy, ShardCore
from ps_server.shard import round_stream

log = logging.getLogger(__name__)

SKIPPED_ROUNDS = 64
"""Skipped rounds a shard remembers, so a PushPull answers whether its round was skipped."""

Gradients = Sequence[torch.Tensor]
"""One 1-D tensor per partition owned by the shard, in plan order."""

Hyperparameters = Sequence[Mapping[str, float]]
"""Per parameter group, the hyperparameters a push sets for its step (empty: none)."""


def agreed_hyperparameters(by_rank: Mapping[int, Hyperparameters]) -> Hyperparameters | None:
    """The one set of hyperparameters every rank sent, or None when they differ."""
    distinct = {tuple(tuple(sorted(g.items())) for g in h) for h in by_rank.values()}
    if len(distinct) > 1:
        return None
    return next(iter(by_rank.values()), ())


def aggregate(grads_by_rank: Mapping[int, Gradients]) -> list[torch.Tensor]:
    """Mean of the ranks' gradients, summed in ascending rank order.

    Args:
        grads_by_rank: rank -> gradients; every rank's list has the same shapes and dtypes.

    Returns:
        One tensor per partition: ``(g[r0] + g[r1] + ...) / len(grads_by_rank)``; with one rank,
        that rank's tensors themselves (read them, do not write them); otherwise new tensors.
        The first sum is one pass (``torch.add``) rather than a copy and an add; the result is
        bitwise the same. It carries the largest of the ranks' bounds (a mean's magnitude is at
        most the largest of its terms'; :class:`~ps_server.core.partitions.Bounded`).

    Raises:
        ValueError: no ranks.
    """
    if not grads_by_rank:
        raise ValueError("aggregate() needs at least one rank's gradients.")
    ranks = sorted(grads_by_rank)
    bound = max(max_abs_of(grads_by_rank[r]) for r in ranks)
    if len(ranks) == 1:
        return Bounded(grads_by_rank[ranks[0]], bound)
    out = [torch.add(a, b) for a, b in zip(grads_by_rank[ranks[0]], grads_by_rank[ranks[1]], strict=True)]
    for r in ranks[2:]:
        for acc, g in zip(out, grads_by_rank[r], strict=True):
            acc.add_(g)
    for acc in out:
        acc.div_(len(ranks))
    return Bounded(out, bound)


class SyncRounds:
    """The open round of a shard in sync mode.

    Args:
        round: the round (= version) to start at.
    """

    def __init__(self, round: int = 0) -> None:
        self.round = round
        self.pending: dict[int, Gradients] = {}
        self.hyper: dict[int, Hyperparameters] = {}
        self.skips: set[int] = set()
        self.taken_hyper: dict[int, Hyperparameters] = {}
        """The hyperparameters of the round :meth:`take_if_complete` last closed, by rank."""
        self.taken_skips: set[int] = set()
        """The ranks of that round that asked to skip its step (AMP overflow)."""

    def add(self, rank: int, clock: int, grads: Gradients, hyper: Hyperparameters = (), skip: bool = False) -> None:
        """Hold ``rank``'s gradients, hyperparameters and skip request for the round ``clock``.

        Raises:
            StalePushError: ``clock`` is an already closed round.
            FutureRoundError: ``clock`` is a future round.
            PreconditionError: ``rank`` already pushed this round.
        """
        if clock < self.round:
            raise StalePushError(
                f"Round {clock} is closed (the shard is at round {self.round}); pull version "
                f"{self.round} and push clock {self.round}."
            )
        if clock > self.round:
            raise FutureRoundError(
                f"Push for round {clock} but the shard is at round {self.round}; pull version {clock} first."
            )
        if rank in self.pending:
            raise PreconditionError(
                f"Rank {rank} already pushed round {clock} under another incarnation; wait for the next round."
            )
        self.pending[rank] = grads
        self.hyper[rank] = hyper
        if skip:
            self.skips.add(rank)

    def close_if_complete(self, expected: Iterable[int], quorum: int = 0) -> list[torch.Tensor] | None:
        """Close the round when every expected rank has pushed, or ``quorum`` pushes arrived.

        Args:
            expected: ranks the round waits for (live, or not yet joined). Pushes already held from
                ranks no longer expected still count.
            quorum: close after the first K pushes whoever sent them (backup workers: Chen, Pan,
                Monga, Bengio, Jozefowicz, "Revisiting Distributed Synchronous SGD", 2016);
                0 waits for every expected rank.

        Returns:
            The rank-ordered mean of the held gradients, and the round advances; or None while
            waiting. A round with no pushes never closes.
        """
        held = self.take_if_complete(expected, quorum)
        return None if held is None else aggregate(held)

    def take_if_complete(self, expected: Iterable[int], quorum: int = 0) -> dict[int, Gradients] | None:
        """Like :meth:`close_if_complete` but returns the held rank -> tensors unreduced (EASGD rounds)."""
        if not self.pending:
            return None
        if not (0 < quorum <= len(self.pending)) and not set(expected) <= self.pending.keys():
            return None
        held, self.pending = self.pending, {}
        self.taken_hyper, self.hyper = self.hyper, {}
        self.taken_skips, self.skips = self.skips, set()
        self.round += 1
        return held

    def waiting_for(self, expected: Iterable[int]) -> list[int]:
        """Expected ranks that have not pushed the open round, ascending."""
        return sorted(set(expected) - self.pending.keys())


class SyncPolicy(ConsistencyPolicy):
    """BSP: a push is held for round ``clock``; the complete round is summed in rank order and
    applied as one step, version ``round + 1`` (``--sync-quorum K``: after the first K pushes, late
    ones dropped; Chen et al. 2016). A read of version v waits for round v - 1."""

    mode = "sync"
    holds_pushes = True

    def accept(
        self,
        shard: ShardCore,
        member: Member,
        stamp: PushStamp,
        grad_version: int,
        grads: Sequence[torch.Tensor],
        hyper: Hyperparameters = (),
        skip: bool = False,
    ) -> PushResult:
        """Hold the push for round ``stamp.clock``; with a quorum, drop a push for a closed round
        (counted ``late``, answered ``dropped``).

        Raises:
            StalePushError: a closed round without a quorum (counted ``stale``). FutureRoundError:
            a future round. PreconditionError: the rank pushed this round under another incarnation.
        """
        rounds = shard.rounds
        if stamp.clock < rounds.round and shard.settings.sync_quorum:
            shard.counters.refuse("late")
            log.info(
                "shard %d: rank %d's push for closed round %d dropped (quorum %d)",
                shard.shard_index,
                member.rank,
                stamp.clock,
                shard.settings.sync_quorum,
            )
            result = PushResult(shard.version, staleness=rounds.round - stamp.clock, dropped=True, mode=self.mode)
        else:
            try:
                rounds.add(member.rank, stamp.clock, grads, hyper, skip)
            except StalePushError:
                shard.counters.refuse("stale")
                raise
            shard.refusals.pop(member.rank, None)  # it moved on from a refused round
            if shard.round_opened is None:
                shard.round_opened, shard.round_reported = shard.now(), False
            result = PushResult(shard.version, mode=self.mode)
        shard.record(member, stamp, result)
        return result

    def read_after_push(self, clock: int) -> int:
        """The version the push's round makes."""
        return clock + 1

    def advance(self, shard: ShardCore) -> None:
        """Close the open round once complete (every expected rank, or the quorum, pushed)."""
        if shard.store is None:
            return
        held = shard.rounds.take_if_complete(shard.membership.expected(shard.rounds.round), shard.settings.sync_quorum)
        if held is not None:
            self._close_round(shard, held)
            shard.round_opened = None

    def _close_round(self, shard: ShardCore, held: dict[int, Gradients]) -> None:
        """Apply the complete round ``held`` with the hyperparameters its ranks agree on, skip its
        step when a rank asked to, or refuse it as a whole; either way but the last, the buffer
        partitions take the values of the round's lowest rank (rank 0)."""
        store, rounds = shard.store, shard.rounds
        assert store is not None
        hyper = agreed_hyperparameters(rounds.taken_hyper)
        if hyper is None or rounds.taken_skips:
            round_stream.end(shard, "its ranks disagree, or one asked to skip")  # type: ignore[arg-type]
        if hyper is None:
            sent = "; ".join(f"rank {r}: {list(h) or 'none'}" for r, h in sorted(rounds.taken_hyper.items()))
            shard.refuse_round(
                held,
                HyperparametersDisagreeError(
                    f"its ranks sent different hyperparameters ({sent[:400]}); every rank must step the same lr "
                    "scheduler (same schedule, same step count) and send the same param groups."
                ),
            )
            return
        lowest = held[min(held)] if store.buffer_index else None
        if rounds.taken_skips:
            if lowest is not None:
                store.assign_buffers(lowest)
            log.info(
                "shard %d: round %d skipped (ranks %s asked to)",
                shard.shard_index,
                rounds.round - 1,
                sorted(rounds.taken_skips),
            )
            shard.skipped_rounds[rounds.round - 1] = None
            while len(shard.skipped_rounds) > SKIPPED_ROUNDS:
                del shard.skipped_rounds[next(iter(shard.skipped_rounds))]
            shard.set_version(rounds.round)
            return
        if round_stream.settle(shard, rounds.round - 1, list(held), hyper, False):  # type: ignore[arg-type]
            shard.set_version(rounds.round)  # stepped slot by slot as its pushes arrived
            log.debug("shard %d: round %d applied (streamed)", shard.shard_index, shard.version - 1)
            return
        try:
            store.apply(aggregate(held), hyper=hyper, buffers=lowest)
        except UpdateRefusedError as exc:
            shard.refuse_round(held, exc)
        else:
            shard.set_version(rounds.round)
            log.debug("shard %d: round %d applied", shard.shard_index, shard.version - 1)

    def quorum(self, settings: ModeSettings) -> int:
        return settings.sync_quorum

    def on_switch(self, shard: ShardCore) -> None:
        """Every rank's clock catches up with the version: the next round is the version."""
        for m in shard.members:
            m.clock = max(m.clock, shard.version)

    def join_clock(self, shard: ShardCore, member: Member, restarted: bool) -> int:
        """A joining rank pushes the open round next (a rejoined rank: its first counted round)."""
        return max(shard.rounds.round, member.since)

    def check_read(self, shard: ShardCore, member: Member, joined: bool, min_version: int) -> None:
        """Tell a rank whose round was refused at once; refuse a wait for a round that holds no push
        of the rank and never will (the shard restarted from an older checkpoint), and a wait for a
        version beyond the one the open round makes (no wait could end on it).

        Raises:
            UpdateRefusedError: the refusal of the round it waits for. PushLostError: as above.
            VersionAheadError: ``min_version`` > the open round + 1.
        """
        rank = member.rank
        if joined and min_version > shard.version and rank in shard.refusals:
            refusal = shard.refusals.pop(rank)  # the round it waits for was refused
            raise type(refusal)(str(refusal))
        round_ = shard.rounds.round
        waits_without_its_push = min_version > shard.version and (
            rank not in shard.rounds.pending or min_version > round_ + 1
        )
        if joined and waits_without_its_push and rank in shard.membership.expected(round_):
            raise PushLostError(
                f"Rank {rank} waits for version {min_version} of shard {shard.shard_index}, whose open round "
                f"{round_} holds no push from it (the shard restarted from an older checkpoint since); "
                f"push round {round_} again, then pull."
            )
        reachable = max(shard.version, round_) + 1  # what the open round makes
        if min_version > reachable:
            raise VersionAheadError(
                f"A pull of version {min_version} waits for nothing shard {shard.shard_index} can make: it holds "
                f"version {shard.version} and its open round {round_} makes {reachable}. Pull at most version "
                f"{reachable} (the round after this rank's last push)."
            )

    def can_read(self, shard: ShardCore, member: Member, joined: bool, min_version: int) -> bool:
        """Version ``min_version`` is there, or the round it waits for was refused."""
        return shard.version >= min_version or (joined and member.rank in shard.refusals)

    def after_read(self, shard: ShardCore, member: Member, joined: bool, min_version: int) -> None:
        """Raises the refusal of the round the wait ended on (UpdateRefusedError)."""
        if shard.version < min_version and member.rank in shard.refusals:
            refusal = shard.refusals.pop(member.rank)
            raise type(refusal)(str(refusal))
