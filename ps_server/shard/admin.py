"""Configuration changes of a shard (:class:`ConfigChanges`): UpdateConfig (mode parameters, the
learning rate, a mode switch at the next round boundary), applying them when due, and the status
snapshot for GetStatus."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from ps_common.codec import torch_dtype
from ps_common.errors import InvalidRequestError, NotInitializedError, PreconditionError
from ps_common.fragments import check_fragments, fragments_in_force
from ps_common.modes import ModeSettings, changes_from_request, request_fields
from ps_common.optimizer import check_in_range
from ps_common.outer_rounds import inner_step
from ps_common.wire import MODE_TO_NAME, NAME_TO_MODE
from ps_proto.v1 import ps_pb2
from ps_server.membership.epochs import KEPT_CHANGES
from ps_server.policy.base import ShardCore
from ps_server.shard.members import ShardMembers, not_authority
from ps_server.shard.views import StatusView
from ps_server.tables.metrics import table_status
from ps_server.tables.store import TableStore

log = logging.getLogger(__name__)


class AdminHost(ShardCore, Protocol):
    """What :class:`ConfigChanges` reads and changes of the shard besides what its policy does
    (:class:`~ps_server.policy.base.ShardCore`): a status shows it all."""

    num_shards: int
    lease_timeout: float
    restored_from_version: int | None
    tables: TableStore
    durable_acks: bool
    last_checkpoint_version: int | None

    def learning_rate(self) -> float: ...


class ConfigChanges:
    """The configuration changes of one shard: scheduled by shard 0 as membership records, applied
    when the shard's version reaches them, a mode switch kept pending (:attr:`pending_mode`) until
    the next round boundary.

    Every method assumes the caller (``ps_server.shard.shard.Shard``) holds the shard's lock; none
    takes it.

    Args:
        host: the shard (read and changed as :class:`AdminHost` says).
        members: the shard's membership glue (records, the default version of a change).
    """

    def __init__(self, host: AdminHost, members: ShardMembers) -> None:
        self._host = host
        self._members = members
        self.pending_mode = ""
        """The mode a due change switches to at the next round boundary ("" if none)."""

    def learning_rate(self) -> float:
        """The optimizer's learning rate in force (0 before Init); needs no lock."""
        store = self._host.store
        return float(store.optimizer.param_groups[0]["lr"]) if store else 0.0

    def update_config(
        self, mode: str = "", learning_rate: float | None = None, at_version: int | None = None, **changes: Any
    ) -> ModeSettings:
        """Shard 0: schedule a change of mode parameters, the learning rate and the mode at version
        ``at_version`` (default: the next round, or this version when no rank is live), a decision of
        the membership authority that every shard applies when its version reaches it (a mode switch
        at the first round boundary from there). Validated in full now: a refused change schedules
        nothing.

        Returns:
            The settings the change makes, in force from its version (until then it shows as pending
            in ``Shard.status``); the mode is the one in force until the switch.

        Raises:
            PreconditionError: not shard 0, or :data:`~ps_server.membership.epochs.KEPT_CHANGES` changes are
                already scheduled and not applied.
            InvalidRequestError: a value out of range (diloco: more fragments than H or than the
                model's parameters), an unknown mode, a switch into or out of easgd,
                or ``at_version`` below the shard's version or an earlier change's; nothing changes.
            NotInitializedError: a learning rate before Init.
        """
        shard = self._host
        if not self._members.epochs.authority:
            raise not_authority(shard.shard_index, "UpdateConfig")
        settings = shard.settings.updated(**changes)
        if shard.plan is not None:
            check_fragments(shard.plan, fragments_in_force(settings))  # diloco: each fragment holds a parameter
        if mode:
            settings.updated(mode=mode)  # validate the switch now
        if learning_rate is not None:
            if not (learning_rate >= 0 and learning_rate < float("inf")):
                raise InvalidRequestError(f"learning_rate must be a finite number >= 0, got {learning_rate}.")
            if shard.store is None or shard.plan is None:
                raise NotInitializedError("Set the learning rate after Init: the optimizer does not exist yet.")
            check_in_range("learning_rate", learning_rate, [torch_dtype(d) for d in shard.plan.dtypes.values()])
        pending = self._members.epochs.pending()
        if len(pending) >= KEPT_CHANGES:  # the record keeps this many: a 17th would push one out
            raise PreconditionError(
                f"{len(pending)} configuration changes are scheduled and not applied yet (the most shard 0 keeps); "
                f"wait until version {pending[0].version}, or schedule fewer."
            )
        floor = max([shard.version, *(c.version for c in pending)])
        at = max(self._members.next_version(), floor) if at_version is None else at_version
        if at < floor:
            raise InvalidRequestError(
                f"at_version {at} is too early: shard 0 is at version {shard.version}"
                + (f" and a change is scheduled at {floor}" if floor > shard.version else "")
                + f"; pick {floor} or later, or leave it out."
            )
        update = ps_pb2.UpdateConfigRequest(**request_fields(changes))
        if mode:
            update.mode = NAME_TO_MODE[mode]
        if learning_rate is not None:
            update.learning_rate = learning_rate
        change = ps_pb2.ConfigChange(version=at, update=update)
        if shard.settings.mode == "diloco":  # the inner step its round starts at (ps_common.outer_rounds)
            change.inner_step = inner_step(shard.settings, self._members.epochs.record.config_changes, at)
        self._members.decide_change(change)
        self.apply_due()
        shard.advance()
        return settings

    def change_config(
        self, mode: str = "", learning_rate: float | None = None, at_version: int | None = None, **changes: Any
    ) -> tuple[ModeSettings, StatusView]:
        """An UpdateConfig request: :meth:`update_config`, and the :meth:`status` after it."""
        settings = self.update_config(mode, learning_rate, at_version, **changes)
        return settings, self.status()

    def apply_due(self) -> None:
        """Apply the scheduled changes the shard's version has reached, in order. A change shard 0
        validated cannot fail here but for a learning rate before this shard's Init (skipped, logged).
        Caller holds the lock."""
        shard = self._host
        for change in self._members.epochs.due(shard.version):
            u = change.update
            shard.settings = shard.settings.updated(**changes_from_request(u))
            if u.HasField("learning_rate"):
                if shard.store is None:
                    log.warning("shard %d: learning rate change skipped: not initialized yet", shard.shard_index)
                else:
                    for group in shard.store.optimizer.param_groups:
                        group["lr"] = u.learning_rate
            mode = MODE_TO_NAME.get(u.mode, "")
            if mode:  # switching back to the mode in force cancels a pending switch
                self.pending_mode = mode if mode != shard.mode else ""
            log.info(
                "shard %d: config change of epoch %d applied at version %d: %s%s",
                shard.shard_index,
                change.epoch,
                shard.version,
                shard.settings,
                f", switching to {mode} at the next round boundary" if self.pending_mode else "",
            )

    def status(self) -> StatusView:
        """A consistent snapshot for operators (refusals and staleness from ``shard.counters``)."""
        shard = self._host
        now = shard.now()
        store = shard.store
        expected = self._members.membership.counted_in(shard.rounds.round)
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
            workers=self._members.membership.views(),
            round_ranks=tuple(sorted(shard.rounds.pending)),
            round_waiting_for=tuple(shard.rounds.waiting_for(expected)) if shard.rounds.pending else (),
            round_age_seconds=0.0 if shard.round_opened is None else now - shard.round_opened,
            pending_mode=self.pending_mode or self.scheduled_mode(),
            max_clock_gap=shard.max_clock_gap,
            rejected_pushes=counted.rejected_pushes,
            staleness=counted.staleness,
            last_checkpoint_version=shard.last_checkpoint_version,
            restored_from_version=shard.restored_from_version,
            membership=self._copy(self._members.epochs.record),
            applied_changes=tuple(self._copy(c) for c in self._members.epochs.applied),
            membership_authority=self._members.epochs.authority,
            durable_acks=shard.durable_acks,
            tables=table_status(shard.tables),
            tables_version=shard.tables.version,
        )

    def scheduled_mode(self) -> str:
        """The mode of the newest scheduled change not applied yet that switches it ("" if none)."""
        shard = self._host
        modes = [MODE_TO_NAME.get(c.update.mode, "") for c in self._members.epochs.pending()]
        mode = next((m for m in reversed(modes) if m), "")
        return mode if mode != shard.mode else ""

    @staticmethod
    def _copy(message: Any) -> Any:
        out = type(message)()
        out.CopyFrom(message)
        return out
