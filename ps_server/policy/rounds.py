"""Sync rounds as data: the open round's held pushes, and their rank-ordered mean.

Round ``t`` collects the pushes with clock ``t``. When every expected rank has pushed (or a quorum
did), :class:`SyncRounds` hands the held gradients back and the round advances; :func:`aggregate`
sums them **in rank order** (never arrival order) and divides by their count, so the result is
bitwise identical whatever the arrival timing. Used by the sync and easgd policies and by the
streamed rounds of the data plane.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ps_common.errors import FutureRoundError, PreconditionError, StalePushError
from ps_server.core.partitions import Bounded, max_abs_of
from ps_server.policy.types import Gradients, Hyperparameters, hyper_key


def agreed_hyperparameters(by_rank: Mapping[int, Hyperparameters]) -> Hyperparameters | None:
    """The one set of hyperparameters every rank sent, or None when they differ."""
    distinct = {hyper_key(h) for h in by_rank.values()}
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


def weighted_aggregate(grads_by_rank: Mapping[int, Gradients], samples: Mapping[int, int]) -> list[torch.Tensor]:
    """FedAvg's weighted mean (McMahan et al. 2017, Algorithm 1: ``sum_k n_k / n * w_k``) of the
    ranks' gradients, summed in ascending rank order.

    Args:
        grads_by_rank: rank -> gradients (1-D tensors per partition, same shapes and dtypes).
        samples: rank -> its sample count n_k (> 0 for every rank of ``grads_by_rank``).

    Returns:
        One new tensor per partition, ``sum_k (n_k / sum n) * g[k]`` (the weights in float64, each
        product in the gradients' dtype); it carries the largest of the ranks' bounds.

    Raises:
        ValueError: no ranks, or a rank without a positive count.
    """
    ranks = sorted(grads_by_rank)
    if not ranks or any(samples.get(r, 0) <= 0 for r in ranks):
        raise ValueError("weighted_aggregate() needs a positive sample count for every rank.")
    total = sum(samples[r] for r in ranks)
    bound = max(max_abs_of(grads_by_rank[r]) for r in ranks)
    out = [torch.mul(g, samples[ranks[0]] / total) for g in grads_by_rank[ranks[0]]]
    for r in ranks[1:]:
        for acc, g in zip(out, grads_by_rank[r], strict=True):
            acc.add_(g, alpha=samples[r] / total)
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
        self.samples: dict[int, int | None] = {}
        self.taken_samples: dict[int, int | None] = {}
        """The sample counts of that round's pushes, by rank (diloco's FedAvg weights)."""

    def add(
        self,
        rank: int,
        clock: int,
        grads: Gradients,
        hyper: Hyperparameters = (),
        skip: bool = False,
        samples: int | None = None,
    ) -> None:
        """Hold ``rank``'s gradients, hyperparameters, skip request and sample count for the round ``clock``.

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
        self.samples[rank] = samples
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
        self.taken_samples, self.samples = self.samples, {}
        self.round += 1
        return held

    def drop(self, rank: int) -> None:
        """Forget ``rank``'s push of the open round (the cluster does not count the rank in it)."""
        self.pending.pop(rank, None)
        self.hyper.pop(rank, None)
        self.samples.pop(rank, None)
        self.skips.discard(rank)

    def waiting_for(self, expected: Iterable[int]) -> list[int]:
        """Expected ranks that have not pushed the open round, ascending."""
        return sorted(set(expected) - self.pending.keys())
