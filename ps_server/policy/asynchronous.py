"""Asynchronous (ASP) updates: each push is one optimizer step at once, with staleness rules.

Staleness of a gradient = shard version now - version the gradient was computed on.
``--max-staleness S`` refuses gradients with staleness > S (the worker pulls and carries on).
``--staleness-lr inverse`` scales the learning rate by ``1 / max(1, staleness)``: the
staleness-dependent learning rate of Zhang, Gupta, Lian, Liu, "Staleness-aware Async-SGD for
Distributed Deep Learning", IJCAI 2016 (section 3, eq. 3).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ps_common.errors import StalePushError, UpdateRefusedError
from ps_server.membership.ranks import Member, PushResult, PushStamp
from ps_server.policy.base import ConsistencyPolicy, ShardCore

if TYPE_CHECKING:
    from ps_server.policy.types import Hyperparameters


def staleness(version_now: int, grad_version: int) -> int:
    """Versions applied since the gradient's parameters were pulled (never negative).

    A gradient claiming a future version is treated as fresh (staleness 0).
    """
    return max(0, version_now - grad_version)


def check_staleness(tau: int, max_staleness: int) -> None:
    """Refuse a gradient that is too old.

    Args:
        tau: the gradient's staleness in versions.
        max_staleness: the bound S; negative means no bound.

    Raises:
        StalePushError: ``tau > max_staleness >= 0``.
    """
    if 0 <= max_staleness < tau:
        raise StalePushError(
            f"Gradient is {tau} versions stale, more than --max-staleness {max_staleness}; "
            "pull the current parameters and compute the next gradient on them."
        )


def lr_scale(tau: int, rule: str) -> float:
    """Learning-rate multiplier for a gradient of staleness ``tau``: ``1 / max(1, tau)`` for
    ``rule == "inverse"`` (Zhang et al. 2016), else 1."""
    return 1.0 / max(1, tau) if rule == "inverse" else 1.0


class ImmediatePolicy(ConsistencyPolicy):
    """Pushes apply at once, one optimizer step each (async, ssp); subclasses say which are too stale
    and at which learning-rate scale the others apply (:meth:`admit`)."""

    staleness_unit = "versions"

    def admit(self, shard: ShardCore, tau: int) -> float:
        """The learning-rate multiplier of a push ``tau`` versions stale.

        Raises:
            StalePushError: too stale to apply.
        """
        return 1.0

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
        """Apply the push now (rank 0's also assigns the buffer partitions); a skipped step counts
        but makes a new version only when it carries rank 0's buffers.

        Raises:
            StalePushError: refused by :meth:`admit` (counted ``stale``). UpdateRefusedError: the
            step was refused; nothing changed.
        """
        store = shard.store
        assert store is not None
        tau = staleness(shard.version, grad_version)
        buffers = grads if member.rank == 0 and store.buffer_index else None
        if skip:  # the rank skipped its step: counted, no step; only rank 0's buffers make a new version
            version = shard.version + (buffers is not None)
            result = PushResult(version, staleness=tau, mode=self.mode, skipped=True)
            shard.record(member, stamp, result)
            shard.membership.applied(member, stamp.incarnation, stamp.clock)
            if buffers is not None:
                store.assign_buffers(buffers)
                shard.set_version(version)
            return result
        try:
            try:
                scale = self.admit(shard, tau)
            except StalePushError:
                shard.counters.refuse("stale")
                raise
            store.apply(grads, lr_scale=scale, hyper=hyper, buffers=buffers)
        except UpdateRefusedError as exc:
            raise shard.refusal(exc, f"the push of rank {member.rank} clock {stamp.clock}", 1) from exc
        result = PushResult(shard.version + 1, staleness=tau, mode=self.mode)
        shard.record(member, stamp, result)
        shard.membership.applied(member, stamp.incarnation, stamp.clock)
        shard.set_version(shard.version + 1)
        return result


class AsyncPolicy(ImmediatePolicy):
    """ASP: every push is one optimizer step at once; ``--max-staleness`` refuses old gradients,
    ``--staleness-lr inverse`` scales the others' learning rate (Zhang et al. 2016, eq. 3)."""

    mode = "async"

    def admit(self, shard: ShardCore, tau: int) -> float:
        """``lr_scale(tau)`` unless ``tau > max_staleness``.

        Raises:
            StalePushError: ``tau`` above ``--max-staleness``.
        """
        check_staleness(tau, shard.settings.max_staleness)
        return lr_scale(tau, shard.settings.staleness_lr)

    def staleness(self, shard: ShardCore, member: Member, grad_version: int) -> int:
        """Versions applied since ``grad_version`` (docs/architecture.md#3-staleness)."""
        return staleness(shard.version, grad_version)
