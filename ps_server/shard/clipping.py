"""Sync rounds held for clipping (:class:`RoundClips`): torch's ``clip_grad_norm_`` of a round's
averaged gradient by its norm over every shard (``docs/architecture.md#7-gradient-path``).

A Push with ``hold_for_clip`` asks for it. When its round completes the sync policy hands the round
here instead of stepping it: the shard keeps the rank-ordered mean of the round's gradients, and
answers every held push with the sum of the squares of that mean over its trained partitions
(float64; buffers excluded). Each worker adds the shards' sums in shard order, takes
``coefficient = min(1, max_norm / (sqrt(sum) + 1e-6))`` (``torch.nn.utils.clip_grad_norm_``) and
sends it with its next Pull (:class:`ps_proto.v1.ps_pb2.ClipCoefficient`): the first coefficient
scales the mean and steps the round as usual; every later one for that round must be the same
number, bitwise (FAILED_PRECONDITION otherwise). While a round is held, the shard's version stays
and the next round is open but receives no push (no rank has the held round's result yet).

The calls a servicer makes (:meth:`RoundClips.request`, ``wait_norm``, ``apply``) take the shard's
lock; the sync policy's hooks run under it (the waits release it while they wait).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ps_common.errors import InvalidRequestError, PreconditionError, UpdateRefusedError
from ps_server.core.partitions import Bounded, max_abs_of
from ps_server.policy.base import ShardCore
from ps_server.policy.rounds import aggregate
from ps_server.policy.types import Gradients, Hyperparameters

log = logging.getLogger(__name__)

CLIP_ROUNDS = 64
"""Rounds whose coefficient a shard remembers, so a late rank's coefficient is still compared."""


@dataclasses.dataclass
class HeldRound:
    """A complete sync round waiting for its clipping coefficient."""

    round: int
    held: dict[int, Gradients]
    """Rank -> its push (told the refusal if the clipped step is refused)."""
    mean: list[torch.Tensor]
    """The rank-ordered mean, one 1-D tensor per partition of the shard (read, never written)."""
    hyper: Hyperparameters
    buffers: Sequence[torch.Tensor] | None
    sum_squares: float


class RoundClips:
    """The clipping requests of the open sync round, the round held for clipping, and the
    coefficients of the last :data:`CLIP_ROUNDS` clipped rounds.

    Args:
        host: the shard, as its policy sees it (:class:`~ps_server.policy.base.ShardCore`).
        cond: the shard's condition (its lock).
    """

    def __init__(self, host: ShardCore, cond: threading.Condition) -> None:
        self._host, self._cond = host, cond
        self.requests: dict[int, set[int]] = {}
        """Round -> ranks that pushed it with ``hold_for_clip``."""
        self.held: HeldRound | None = None
        self.coefficients: dict[int, float] = {}
        """Round -> the coefficient it was stepped with (ordered, bounded)."""
        self.norms: dict[int, float] = {}
        """Round -> its sum of squares, for a repeated push's answer (ordered, bounded)."""

    @property
    def held_round(self) -> int | None:
        """The round held for its coefficient, if any."""
        return None if self.held is None else self.held.round

    def request(self, rank: int, round_: int) -> None:
        """``rank`` pushes ``round_`` with ``hold_for_clip`` (before the push is applied). Only the
        open round is noted; a push for another is refused or repeated by the push itself.

        Raises:
            PreconditionError: the mode has no rounds (only sync averages a round's gradients).
        """
        with self._cond:
            host = self._host
            if not host.policy.holds_pushes:
                raise PreconditionError(
                    f"hold_for_clip is for sync rounds; this cluster runs {host.policy.mode}, where no round's average "
                    "exists to clip. Nothing was applied."
                )
            if round_ == host.rounds.round and self.held is None:
                self.requests.setdefault(round_, set()).add(rank)

    # ----------------------------------------------------------------- the sync policy's hook
    def wanted(self, round_: int, ranks: Sequence[int]) -> bool:
        """At the close of ``round_`` (pushes of ``ranks``): whether one of them asked to hold it."""
        asked = self.requests.pop(round_, set())
        for old in [r for r in self.requests if r < round_]:
            del self.requests[old]
        return bool(asked & set(ranks))

    def hold(self, round_: int, held: dict[int, Gradients], hyper: Hyperparameters, buffers: Any) -> None:
        """Keep the complete round ``round_`` unapplied (a stream of it is put back) and compute its
        sum of squares over the trained partitions, in partition order, in float64."""
        host = self._host
        assert host.store is not None
        if host.stream is not None:
            host.stream.stop(host, "its round is held for clipping")
        mean = aggregate(held)
        store = host.store
        trained = [mean[i] for i in store.trained_index] if store.buffer_index else list(mean)
        total = 0.0
        for t in trained:
            total += float(t.double().square().sum())
        self.held = HeldRound(round_, held, mean, hyper, buffers, total)
        _remember(self.norms, round_, total)
        log.debug("shard %d: round %d held for clipping (sum of squares %r)", host.shard_index, round_, total)

    # ----------------------------------------------------------------- the calls
    def wait_norm(self, rank: int, round_: int, timeout: float | None) -> tuple[int, float | None]:
        """After ``rank``'s push of ``round_`` with ``hold_for_clip``: wait until the round is held
        (or was stepped, skipped or refused without being held) and answer it.

        Returns:
            (round, its sum of squares), also once stepped (a repeated push); (round, None) when
            the round was skipped (a rank's AMP overflow) instead of held.

        Raises:
            UpdateRefusedError: the round was refused (its ranks disagree on hyperparameters).
            PreconditionError: the round was stepped without being held.
            WaitTimeoutError: not complete in ``timeout`` seconds. ShuttingDownError.
        """
        with self._cond:
            host = self._host
            deadline = None if timeout is None else host.now() + timeout

            def ready() -> bool:
                return self.held_round == round_ or host.version > round_ or rank in host.refusals

            host.wait_for_ranks(
                ready,
                deadline,
                lambda: (
                    f"Round {round_} held for clipping not complete in time (shard {host.shard_index}; round waits "
                    f"for ranks {host.rounds.waiting_for(host.membership.counted_in(host.rounds.round))}); check those "
                    "workers."
                ),
            )
            if host.version <= round_ and rank in host.refusals:
                refusal = host.refusals.pop(rank)
                raise type(refusal)(str(refusal))
            if round_ in self.norms:
                return round_, self.norms[round_]
            if round_ in host.skipped_rounds:
                return round_, None
            raise PreconditionError(
                f"Round {round_} of shard {host.shard_index} was stepped without being held for clipping; "
                "every rank must call clip_grad_norm_ before step() in the same rounds."
            )

    def apply(self, rank: int, incarnation: int, round_: int, coefficient: float) -> None:
        """Step the held round ``round_`` with its mean times ``coefficient`` (the first rank's);
        check a later rank's against it. A coefficient for a round not held here (already
        stepped by another rank's, skipped, or a rank not in it) changes nothing.

        Raises:
            InvalidRequestError: ``coefficient`` not in (0, 1].
            PreconditionError: another coefficient than the one ``round_`` was stepped with.
            NotJoinedError, SupersededError: ``rank`` is not live under ``incarnation``.
        """
        with self._cond:
            host = self._host
            host.membership.check_live(host.membership.get(rank, incarnation), incarnation)
            if not (0.0 < coefficient <= 1.0):  # NaN fails too
                raise InvalidRequestError(
                    f"Clip coefficient {coefficient!r} for round {round_} is not in (0, 1]; it is "
                    "min(1, max_norm / (total_norm + 1e-6)) with max_norm > 0. Nothing was applied."
                )
            seen = self.coefficients.get(round_)
            if seen is not None:
                if seen != coefficient:
                    raise PreconditionError(
                        f"Rank {rank} clips round {round_} by {coefficient!r}, but shard {host.shard_index} stepped it "
                        f"by {seen!r}, another rank's: every rank must call clip_grad_norm_ with the same max_norm "
                        "(the shards' norms are the same for every rank)."
                    )
                return
            held = self.held
            if held is None or held.round != round_ or rank not in held.held:
                return
            assert host.store is not None
            scaled = Bounded([g * coefficient for g in held.mean], max_abs_of(held.mean))
            self.held = None
            _remember(self.coefficients, round_, coefficient)
            try:
                host.store.apply(scaled, hyper=held.hyper, buffers=held.buffers)
            except UpdateRefusedError as exc:
                del self.coefficients[round_], self.norms[round_]
                host.refuse_round(held.held, exc)
            else:
                host.set_version(round_ + 1)
                log.debug("shard %d: round %d applied, clipped by %r", host.shard_index, round_, coefficient)
            host.advance()

    def forget(self) -> None:
        """The parameters were replaced (Init, restore): nothing is held or remembered."""
        self.requests.clear()
        self.held = None
        self.coefficients.clear()
        self.norms.clear()


def _remember(by_round: dict[int, float], round_: int, value: float) -> None:
    """``by_round[round_] = value``, keeping the last :data:`CLIP_ROUNDS` rounds."""
    by_round[round_] = value
    while len(by_round) > CLIP_ROUNDS:
        del by_round[next(iter(by_round))]
