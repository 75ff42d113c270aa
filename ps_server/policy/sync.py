"""Synchronous (BSP) rounds: one gradient per live rank per round, summed in rank order.

Round ``t`` collects the pushes with clock ``t`` (:class:`~ps_server.policy.rounds.SyncRounds`).
When every expected rank has pushed, the gradients are summed **in rank order** (never arrival
order), divided by their count, and handed back for one optimizer step; the version becomes
``t + 1``. Because the order of floating-point additions is fixed, the result is bitwise identical
whatever the arrival timing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ps_common.errors import (
    HyperparametersDisagreeError,
    PreconditionError,
    PushLostError,
    StalePushError,
    UpdateRefusedError,
    VersionAheadError,
)
from ps_common.modes import ModeSettings
from ps_server.membership.ranks import Member, Membership, PushResult, PushStamp
from ps_server.policy.base import ConsistencyPolicy, ShardCore
from ps_server.policy.rounds import SyncRounds, aggregate, agreed_hyperparameters
from ps_server.policy.types import Gradients, Hyperparameters

__all__ = [
    "SKIPPED_ROUNDS",
    "Gradients",
    "Hyperparameters",
    "SyncPolicy",
    "SyncRounds",
    "aggregate",
    "agreed_hyperparameters",
]

log = logging.getLogger(__name__)

SKIPPED_ROUNDS = 64
"""Skipped rounds a shard remembers, so a PushPull answers whether its round was skipped."""


class SyncPolicy(ConsistencyPolicy):
    """BSP: a push is held for round ``clock``; the complete round is summed in rank order and
    applied as one step, version ``round + 1`` (``--sync-quorum K``: after the first K pushes, late
    ones dropped; Chen et al. 2016). A read of version v waits for round v - 1."""

    mode = "sync"
    holds_pushes = True
    row_rounds = True

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
                rounds.add(member.rank, stamp.clock, grads, hyper, skip, stamp.samples)
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
        held = shard.rounds.take_if_complete(
            shard.membership.counted_in(shard.rounds.round), shard.settings.sync_quorum
        )
        if held is not None:
            self._close_round(shard, held)
            shard.round_opened = None

    def _close_round(self, shard: ShardCore, held: dict[int, Gradients]) -> None:
        """Apply the complete round ``held`` with the hyperparameters its ranks agree on, skip its
        step when a rank asked to, or refuse it as a whole; either way but the last, the buffer
        partitions take the values of the round's lowest rank (rank 0)."""
        store, rounds = shard.store, shard.rounds
        assert store is not None
        clip = shard.clips.wanted(rounds.round - 1, list(held))
        hyper = agreed_hyperparameters(rounds.taken_hyper)
        if (hyper is None or rounds.taken_skips) and shard.stream is not None:
            shard.stream.stop(shard, "its ranks disagree, or one asked to skip")
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
        lowest = self.expand(shard, held[min(held)]) if store.buffer_index else None
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
        if clip:  # stepped when its coefficient comes (ps_server.shard.clipping)
            shard.clips.hold(rounds.round - 1, held, hyper, lowest)
            return
        if shard.stream is not None and shard.stream.settle(shard, rounds.round - 1, list(held), hyper):
            shard.set_version(rounds.round)  # stepped slot by slot as its pushes arrived
            log.debug("shard %d: round %d applied (streamed)", shard.shard_index, shard.version - 1)
            return
        try:
            store.apply(self.expand(shard, self.mean(shard, held)), hyper=hyper, buffers=lowest)
        except UpdateRefusedError as exc:
            shard.refuse_round(held, exc)
        else:
            shard.set_version(rounds.round)
            log.debug("shard %d: round %d applied", shard.shard_index, shard.version - 1)

    def mean(self, shard: ShardCore, held: dict[int, Gradients]) -> list[torch.Tensor]:
        """The round's gradient: the rank-ordered mean of ``held`` (:func:`aggregate`).

        Raises:
            UpdateRefusedError: the round cannot be reduced (diloco's sample counts); refused whole.
        """
        return aggregate(held)

    def expand(self, shard: ShardCore, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor | None]:
        """The closed round's tensors as one per partition of the shard (None: a partition the round
        leaves alone; diloco's fragments). Here: ``tensors`` themselves, a round carries every partition."""
        return tensors

    def quorum(self, settings: ModeSettings) -> int:
        return settings.sync_quorum

    def on_switch(self, shard: ShardCore) -> None:
        """Every rank's clock catches up with the version: the next round is the version."""
        for m in shard.members:
            m.clock = max(m.clock, shard.version)

    def join_clock(self, shard: ShardCore, member: Member, restarted: bool) -> int:
        """A joining rank pushes the open round next (a rejoined rank: its first counted round, unless
        the open round still counts its process's push: ps_server.shard.atomic_rounds)."""
        round_ = shard.rounds.round
        if not restarted and Membership.counts_old_push(member, member.incarnation, round_):
            return round_  # a shard behind (restarted) still needs its pushes of the rounds shard 0 took
        return max(round_, member.since)

    def check_read(self, shard: ShardCore, member: Member, joined: bool, min_version: int) -> None:
        """Tell a rank whose round was refused at once; refuse a wait for a round that holds no push
        of the rank and never will (the shard restarted from an older checkpoint), and a wait for a
        version beyond the one the open round makes (no wait could end on it).

        Raises:
            UpdateRefusedError: the refusal of the round it waits for. PushLostError: as above.
            VersionAheadError: ``min_version`` > the open round + 1, for a rank counted before
                ``min_version``.
        """
        rank = member.rank
        if shard.lost_round and min_version > shard.version:
            raise PreconditionError(shard.lost_round)
        if min_version > shard.version and rank in shard.refusals:
            refusal = shard.refusals.pop(rank)  # the round it waits for was refused
            raise type(refusal)(str(refusal))
        round_ = shard.rounds.round
        waits_without_its_push = (
            min_version > shard.version
            and (rank not in shard.rounds.pending or min_version > round_ + 1)
            and shard.clips.held_round != min_version - 1  # a held round is stepped by its coefficient
        )
        if joined and waits_without_its_push and rank in shard.membership.counted_in(round_):
            raise PushLostError(
                f"Rank {rank} waits for version {min_version} of shard {shard.shard_index}, whose open round "
                f"{round_} holds no push from it (the shard restarted from an older checkpoint since); "
                f"push round {round_} again, then pull."
            )
        reachable = max(shard.version, round_) + 1  # what the open round makes
        # beyond it: rounds this rank pushes (a wait no push of its could end), unless it counts only
        # from the version it waits for (rejoined: the other ranks' rounds make it, a shard that
        # restarted behind them included)
        if min_version > reachable and not (joined and member.counted and member.since >= min_version):
            raise VersionAheadError(
                f"A pull of version {min_version} waits for nothing shard {shard.shard_index} can make: it holds "
                f"version {shard.version} and its open round {round_} makes {reachable}. Pull at most version "
                f"{reachable} (the round after this rank's last push)."
            )

    def can_read(self, shard: ShardCore, member: Member, joined: bool, min_version: int) -> bool:
        """Version ``min_version`` is there, or the round it waits for was refused."""
        return shard.version >= min_version or member.rank in shard.refusals or bool(shard.lost_round)

    def after_read(self, shard: ShardCore, member: Member, joined: bool, min_version: int) -> None:
        """Raises the refusal of the round the wait ended on (UpdateRefusedError), or the shard's
        lost round (PreconditionError: ps_server.shard.atomic_rounds)."""
        if shard.lost_round and shard.version < min_version:
            raise PreconditionError(shard.lost_round)
        if shard.version < min_version and member.rank in shard.refusals:
            refusal = shard.refusals.pop(member.rank)
            raise type(refusal)(str(refusal))

    def may_stream(self, settings: ModeSettings) -> bool:
        """A round streams unless it closes on a quorum (``--sync-quorum``: which pushes count is
        known only at the close)."""
        return not settings.sync_quorum

    def row_clock(self, table_version: int, last_clock: int | None) -> int:
        """The open table round (= the table version)."""
        return table_version
