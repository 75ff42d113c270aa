"""Elastic averaging SGD (EASGD): the center variable and the elastic difference.

Asynchronous EASGD (Zhang, Choromanska, LeCun, "Deep learning with Elastic Averaging SGD",
NIPS 2015, Algorithm 1): every tau local steps a worker sends its parameters x; the shard computes
``d = alpha * (x - center)``, sets ``center += d`` atomically and returns d; the worker sets
``x -= d``. Synchronous EASGD (same paper, eqs. 5-6): all live workers' x of one period are taken
against the same center, ``d_i = alpha * (x_i - center)``, and ``center += sum_i d_i`` summed in
rank order.

Both are all or nothing: when the new center (or a d) would hold inf or NaN, although x was finite
(``x - center`` overflows), nothing changes and :class:`NonFiniteUpdateError` is raised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from ps_common.errors import NonFiniteUpdateError, PreconditionError, UpdateRefusedError
from ps_server.core.finite import all_finite
from ps_server.membership.ranks import Member, PushResult, PushStamp
from ps_server.policy.base import ConsistencyPolicy, ShardCore
from ps_server.policy.types import Awaited

if TYPE_CHECKING:
    from ps_server.policy.types import Hyperparameters


def elastic_difference(center: Sequence[torch.Tensor], x: Sequence[torch.Tensor], alpha: float) -> list[torch.Tensor]:
    """``d = alpha * (x - center)`` per partition (new tensors; inputs unchanged).

    Args:
        center: 1-D tensors, one per partition.
        x: the worker's values, same shapes.
        alpha: moving rate in (0, 1].
    """
    return [(xi.to(ci.dtype) - ci).mul_(alpha) for ci, xi in zip(center, x, strict=True)]


def _commit(center: Sequence[torch.Tensor], new: Sequence[torch.Tensor], ds: Sequence[torch.Tensor]) -> None:
    """Copy ``new`` into ``center`` when it and every d are finite.

    Raises:
        NonFiniteUpdateError: otherwise; ``center`` is unchanged.
    """
    if not (all_finite(new) and all_finite(ds)):
        raise NonFiniteUpdateError(
            "The exchange would make the center non-finite (inf or NaN): x - center overflows; it was refused and "
            "the center is unchanged."
        )
    for ci, ni in zip(center, new, strict=True):
        ci.copy_(ni)


def exchange(center: Sequence[torch.Tensor], x: Sequence[torch.Tensor], alpha: float) -> list[torch.Tensor]:
    """Async EASGD (Algorithm 1): return d and apply ``center += d`` in place.

    Raises:
        NonFiniteUpdateError: d or the new center would not be finite; nothing changed.
    """
    d = elastic_difference(center, x, alpha)
    _commit(center, [ci + di for ci, di in zip(center, d, strict=True)], d)
    return d


def exchange_round(
    center: Sequence[torch.Tensor], xs: Mapping[int, Sequence[torch.Tensor]], alpha: float
) -> dict[int, list[torch.Tensor]]:
    """Sync EASGD (eqs. 5-6): every rank's d against the same center, then ``center += sum d``
    in ascending rank order. Returns rank -> d.

    Raises:
        NonFiniteUpdateError: a d or the new center would not be finite; nothing changed.
    """
    ds = {r: elastic_difference(center, xs[r], alpha) for r in sorted(xs)}
    new = [ci.clone() for ci in center]
    for r in sorted(ds):
        for ni, di in zip(new, ds[r], strict=True):
            ni.add_(di)
    _commit(center, new, [di for r in sorted(ds) for di in ds[r]])
    return ds


class EasgdPolicy(ConsistencyPolicy):
    """EASGD: workers exchange parameters every tau steps instead of pushing gradients. Async
    (Algorithm 1) applies each exchange at once; ``--easgd-sync`` (eqs. 5-6) applies one period's
    exchanges of every live rank together, in rank order, when the period is complete."""

    mode = "easgd"
    exchanges = True
    resizable = False

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
        """Raises PreconditionError: easgd takes exchanges, not pushes."""
        raise PreconditionError("This cluster runs easgd: workers call Exchange every tau steps, not Push.")

    def exchange(
        self, shard: ShardCore, member: Member, stamp: PushStamp, x: Sequence[torch.Tensor], deadline: float | None
    ) -> tuple[int, list[torch.Tensor]]:
        """Apply ``member``'s x (1-D tensors per partition, plan order): at once, or with its period.

        Returns:
            (the version it made, d = alpha (x - center) per partition).

        Raises:
            UpdateRefusedError: the exchange (or its period) was refused; nothing changed.
            WaitTimeoutError, RanksMissingError, ShuttingDownError: sync period not complete.
        """
        store, rank = shard.store, member.rank
        assert store is not None
        if shard.settings.easgd_sync:
            shard.exchange_results.pop(rank, None)
            shard.rounds.add(rank, stamp.clock, [t.clone() for t in x])
            shard.refusals.pop(rank, None)
            shard.advance()
            shard.wait_for_ranks(
                lambda: rank in shard.exchange_results or rank in shard.refusals,
                deadline,
                lambda: (
                    f"EASGD period {stamp.clock} waits for ranks "
                    f"{shard.rounds.waiting_for(shard.membership.expected())}; check those workers."
                ),
                lambda: Awaited(
                    f"EASGD period {stamp.clock}", shard.rounds.waiting_for(shard.membership.expected()), "exchanged"
                ),
            )
            if rank in shard.refusals:
                refusal = shard.refusals.pop(rank)
                raise type(refusal)(str(refusal))
            version, d = shard.exchange_results.pop(rank)
            _exchanged(shard, member, stamp, version, d)
            return version, d
        try:
            d = exchange(store.tensors, x, shard.settings.moving_rate)
        except UpdateRefusedError as exc:
            raise shard.refusal(exc, f"the exchange of rank {rank} clock {stamp.clock}", 1) from exc
        version = shard.version + 1
        _exchanged(shard, member, stamp, version, d)
        shard.set_version(version)
        return version, d

    def check_rows(self) -> None:
        """Raises PreconditionError: elastic averaging of a table would move every row."""
        raise PreconditionError(
            "Embedding tables are not served in easgd mode (elastic averaging would move every row); run "
            "sync, async or ssp, or keep the embedding dense (sparse=False)."
        )

    def advance(self, shard: ShardCore) -> None:
        """``--easgd-sync``: apply the period once every expected rank exchanged (version = period + 1)."""
        if shard.store is None or not shard.settings.easgd_sync:
            return
        held = shard.rounds.take_if_complete(shard.membership.expected())
        if held is None:
            return
        try:
            ds = exchange_round(shard.store.tensors, held, shard.settings.moving_rate)
        except UpdateRefusedError as exc:
            shard.refuse_round(held, exc)
        else:
            for rank, d in ds.items():
                shard.exchange_results[rank] = (shard.rounds.round, d)
            shard.set_version(shard.rounds.round)


def _exchanged(shard: ShardCore, member: Member, stamp: PushStamp, version: int, d: list[torch.Tensor]) -> None:
    """Account an applied exchange (before a snapshot of the version it makes is taken)."""
    member.last_exchange = ((stamp.incarnation, stamp.clock), version, d)
    shard.membership.applied(member, stamp.incarnation, stamp.clock)
    member.clock = max(member.clock, stamp.clock + 1)
    member.pushes += 1
    shard.membership.touch(member)
