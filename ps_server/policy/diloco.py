"""Local SGD with an outer optimizer: DiLoCo and FedAvg (docs/architecture.md#5-consistency).

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models", arXiv:2311.08105, Algorithm 1): every worker takes H inner steps with its own optimizer
from the global parameters theta, then the outer gradient ``delta_i = theta - theta_i`` of every
worker is averaged and the **outer optimizer** steps theta with it. Here the outer optimizer is the
shard's server-side optimizer (``{"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": true}``
is the paper's), and an outer round is a sync round: one push per live rank, reduced in rank order,
one step, version + 1 — so everything a sync round promises (exactly-once pushes, checkpoints,
rejoin) holds for it.

FedAvg (McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized
Data", Algorithm 1, ``w <- sum_k n_k / n * w_k``) is the same round with outer SGD at lr 1.0 and
every rank's delta weighted by the samples it trained on (``PushHeader.sample_count``; 0 weighs nothing): with
weights w_k = theta - delta_k, ``theta - sum_k n_k/n * delta_k`` is exactly that average.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ps_common.errors import HyperparametersDisagreeError, PreconditionError
from ps_common.fragments import fragments_in_force, owned_slots
from ps_common.modes import ModeSettings
from ps_server.core.partitions import Bounded
from ps_server.policy.base import ShardCore
from ps_server.policy.rounds import aggregate, weighted_aggregate
from ps_server.policy.sync import SyncPolicy
from ps_server.policy.types import Gradients


class DilocoPolicy(SyncPolicy):
    """DiLoCo / FedAvg: an outer round is a sync round whose pushes are outer gradients
    ``theta_global - theta_local`` (one per rank every H inner steps), averaged in rank order —
    weighted by each rank's sample count when every rank sent one — and applied by the server
    optimizer (the outer optimizer). Resizable like sync, at an outer round: ranks beyond the new
    count push their last round before it, a new rank starts its inner steps from that round's
    theta_global. No rows (a local copy of a table would move every row), no streamed rounds (the
    weights are known only when the round closes). Any uint64 sample count is valid: the
    weights n_k / n are divided from Python integers.

    Streaming DiLoCo (``--fragments F``, Douillard et al. 2025, arXiv:2501.18512): round ``t``
    carries only the shard's partitions of fragment ``t mod F`` (:mod:`ps_common.fragments`); the
    outer optimizer steps those alone (the others get no gradient, so torch.optim leaves them and
    their momentum as they are)."""

    mode = "diloco"
    resizable = True

    def mean(self, shard: ShardCore, held: dict[int, Gradients]) -> list[torch.Tensor]:
        """The outer gradient: FedAvg's weighted mean when every rank sent a sample count (a rank
        that counted 0 weighs nothing; when every rank counted 0 the outer gradient is zero: FedAvg's
        outer SGD leaves theta_global as it is), the plain rank-ordered mean when none did.

        Raises:
            HyperparametersDisagreeError: some ranks sent a count and others did not (the round is
                refused whole; every rank must count its samples, or none).
        """
        samples = {r: shard.rounds.taken_samples.get(r) for r in held}
        counted = {r for r, n in samples.items() if n is not None}
        if not counted:
            return aggregate(held)
        if counted != set(held):
            raise HyperparametersDisagreeError(
                f"ranks {sorted(counted)} sent sample counts and ranks {sorted(set(held) - counted)} did not; every "
                "rank must call DistributedOptimizer.count_samples (FedAvg weights), or none."
            )
        weights = {r: int(n) for r, n in samples.items() if n}
        if not weights:
            return Bounded([torch.zeros_like(t) for t in held[min(held)]], 0.0)
        return weighted_aggregate({r: held[r] for r in weights}, weights)

    def expand(self, shard: ShardCore, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor | None]:
        """With F > 1 fragments: the closed round's tensors (its fragment's partitions, plan order) put
        at their partitions' places, None elsewhere (:meth:`ParameterStore.apply` leaves those alone)."""
        store = shard.store
        assert store is not None
        slots = owned_slots(store.plan, shard.shard_index, fragments_in_force(shard.settings), shard.rounds.round - 1)
        if slots is None:
            return tensors
        full: list[torch.Tensor | None] = [None] * len(store.partitions)
        for i, t in zip(slots, tensors, strict=True):
            full[i] = t
        return full

    def may_stream(self, settings: ModeSettings) -> bool:
        """Never: the weights of a round are known only once every rank pushed it."""
        return False

    def check_rows(self) -> None:
        """Raises PreconditionError: a worker's local copy of a table would move every row."""
        raise PreconditionError(
            "Embedding tables are not served in diloco mode (each worker would train a local copy of every row); "
            "run sync, async or ssp, or keep the embedding dense (sparse=False)."
        )
