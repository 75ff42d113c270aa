"""Admin calls of a :class:`~ps_server.shard.Shard`: UpdateConfig (mode parameters, the learning
rate, a mode switch at the next round boundary) and the status snapshot for GetStatus."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ps_common.codec import torch_dtype
from ps_common.errors import InvalidRequestError, NotInitializedError
from ps_common.modes import ModeSettings
from ps_common.optimizer import check_in_range
from ps_server.shard_views import StatusView

if TYPE_CHECKING:
    from ps_server.shard import Shard

log = logging.getLogger("ps_server.shard")


def update_config(shard: Shard, mode: str = "", learning_rate: float | None = None, **changes: Any) -> ModeSettings:
    """Change mode parameters and the learning rate at once; a mode switch waits for the next
    round boundary (at once when no sync round is open): the shard's policy changes with it.

    Returns:
        The settings in force (a pending switch shows in ``Shard.status``).

    Raises:
        InvalidRequestError: a value out of range, an unknown mode, or a switch into or out of
            easgd; nothing changes.
        NotInitializedError: a learning rate before Init.
    """
    with shard._cond:
        settings = shard.settings.updated(**changes)
        if mode:
            settings.updated(mode=mode)  # validate the switch now
        if learning_rate is not None:
            if not (learning_rate >= 0 and learning_rate < float("inf")):
                raise InvalidRequestError(f"learning_rate must be a finite number >= 0, got {learning_rate}.")
            if shard.store is None or shard.plan is None:
                raise NotInitializedError("Set the learning rate after Init: the optimizer does not exist yet.")
            check_in_range("learning_rate", learning_rate, [torch_dtype(d) for d in shard.plan.dtypes.values()])
            for group in shard.store.optimizer.param_groups:
                group["lr"] = learning_rate
        shard.settings = settings
        if mode:  # switching back to the mode in force cancels a pending switch
            shard.pending_mode = mode if mode != shard.mode else ""
        log.info(
            "shard %d: config now %s%s",
            shard.shard_index,
            shard.settings,
            f", switching to {mode} at the next round boundary" if shard.pending_mode else "",
        )
        shard.advance()
        return shard.settings


def status(shard: Shard) -> StatusView:
    """A consistent snapshot for operators (refusals and staleness from ``shard.counters``)."""
    with shard._cond:
        now = shard.now()
        store = shard.store
        expected = shard.membership.expected()
        counted = shard.counters.view()
        return StatusView(
            shard_index=shard.shard_index,
            num_shards=shard.num_shards,
            settings=shard.settings,
            lease_timeout=shard.lease_timeout,
            learning_rate=shard.learning_rate(),
            initialized=shard.plan is not None,
            version=shard.version,
            plan_digest=shard.plan.digest if shard.plan else "",
            num_partitions=len(store.partitions) if store else 0,
            num_elements=store.num_elements if store else 0,
            parameter_bytes=store.num_bytes if store else 0,
            optimizer=store.optimizer_spec if store else None,
            workers=shard.membership.views(),
            round_ranks=tuple(sorted(shard.rounds.pending)),
            round_waiting_for=tuple(shard.rounds.waiting_for(expected)) if shard.rounds.pending else (),
            round_age_seconds=0.0 if shard.round_opened is None else now - shard.round_opened,
            pending_mode=shard.pending_mode,
            max_clock_gap=shard.max_clock_gap,
            rejected_pushes=counted.rejected_pushes,
            staleness=counted.staleness,
            last_checkpoint_version=shard.last_checkpoint_version,
            restored_from_version=shard.restored_from_version,
        )
