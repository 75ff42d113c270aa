"""A shard's state as plain data for checkpoints (the snapshot codec): what :meth:`Shard.export_state`
writes and :meth:`Shard.restore` reads; ``torch.load(weights_only=True)`` reads it: no pickled objects."""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from ps_common.errors import CheckpointError, InvalidRequestError, NotInitializedError
from ps_common.optimizer import OptimizerSpec
from ps_common.plan import ParameterSpec, Plan, plan_for_digest
from ps_server.checkpoint.checks import check_layout, check_tensors, load_optimizer_state
from ps_server.membership.epochs import Epochs
from ps_server.membership.ranks import Membership
from ps_server.policy.rounds import SyncRounds
from ps_server.shard.members import ShardMembers
from ps_server.shard.store import ParameterStore
from ps_server.tables.store import TableStore

log = logging.getLogger(__name__)


class StateCodec:
    """Turns the state of shard ``shard_index`` of ``num_shards`` into plain data and back.

    Its methods read and write only what they are given; the caller holds the shard's lock, so
    what it reads is consistent (``ps_server.shard.shard.Shard`` takes it).
    """

    def __init__(self, shard_index: int, num_shards: int) -> None:
        self.shard_index = shard_index
        self.num_shards = num_shards

    def export(
        self,
        plan: Plan | None,
        store: ParameterStore | None,
        version: int,
        mode: str,
        rounds: SyncRounds,
        members: ShardMembers,
        tables: TableStore,
    ) -> dict[str, Any]:
        """Everything a restarted shard needs, as plain data: :func:`export_state` of its ``plan``,
        parameters (copies), optimizer, ``version``, ``mode`` and members, its membership epochs, the
        ``--num-workers`` it was started with, and its ``tables`` (when any). The open round's held
        pushes (``rounds``) are left out, and so are their traces in the members (a remembered answer
        would make the rank's push again a duplicate after a restart). Caller holds the shard's lock.

        Raises:
            NotInitializedError: nothing to save yet.
        """
        if plan is None or store is None:
            raise NotInitializedError(f"Shard {self.shard_index} has nothing to checkpoint before Init.")
        if rounds.pending:
            log.info(
                "shard %d: snapshot at version %d leaves out the open round's pushes from ranks %s",
                *(self.shard_index, version, sorted(rounds.pending)),
            )
        held = dict.fromkeys(rounds.pending, rounds.round)
        state = export_state(plan, store, version, mode, members.membership, held)
        state["epochs"] = members.epochs.export()
        state["configured_num_workers"] = members.configured_num_workers
        if tables.tables:
            tables.expire(None)  # expired rows leave at checkpoint time (docs/tables.md)
            state["tables"] = tables.export()
        return state

    def load(self, state: dict[str, Any]) -> tuple[Plan, ParameterStore]:
        """The plan and the store of :meth:`export` output (no lock needed: nothing shared is read).

        Raises:
            CheckpointError: the checkpoint belongs to another cluster shape or plan.
        """
        return load_state(state, self.shard_index, self.num_shards)

    @staticmethod
    def restore(state: dict[str, Any], membership: Membership, epochs: Epochs, tables: TableStore) -> None:
        """Put the members, membership epochs and tables of :meth:`export` output back. Caller
        holds the shard's lock."""
        tables.restore(state.get("tables"))  # first: CheckpointError when they exceed the shard's bounds
        membership.restore(state["members"])
        epochs.restore(state.get("epochs"))


def export_state(
    plan: Plan,
    store: ParameterStore,
    version: int,
    mode: str,
    membership: Membership,
    held: Mapping[int, int] | None = None,
) -> dict[str, Any]:
    """Plan, parameter tensors (copies), optimizer spec and state, version, mode and members
    (``held``: rank -> clock of a push held in an open round, left out: :meth:`Membership.export`).

    Caller holds the shard's lock, so the copy is consistent.
    """
    spec = store.optimizer_spec
    return {
        "plan": {
            "specs": [[sp.key, list(sp.shape), sp.dtype] for sp in plan.specs],
            "num_shards": plan.num_shards,
            "partition_bytes": plan.partition_bytes,
            "digest": plan.digest,
        },
        "tensors": [t.detach().clone() for t in store.tensors],
        "optimizer": {
            "name": spec.name,
            "kwargs": dict(spec.kwargs),
            "groups": [[list(keys), dict(kw)] for keys, kw in spec.groups],
            "buffers": list(spec.buffers),
        },
        "optimizer_state": copy.deepcopy(store.optimizer.state_dict()),
        "version": version,
        "mode": mode,
        "members": membership.export(held),
    }


def shard_count_refusal(saved: int, running: int, directory: object = "CHECKPOINT_DIR") -> str:
    """What a shard of ``running`` shards says of a checkpoint of ``saved`` shards in ``directory``."""
    return (
        f"The checkpoint is of a cluster with {saved} shards, but this shard runs with {running}; start with "
        "the same --num-shards or another --checkpoint-dir, or stop the job and restore its checkpoints onto "
        f"{running} shards with `ps-admin reshard --from {directory} --to {running}` "
        "(docs/operations.md#reshard-restore-a-job-onto-another-shard-count)."
    )


def load_state(state: dict[str, Any], shard_index: int, num_shards: int) -> tuple[Plan, ParameterStore]:
    """The plan and the store (parameters and optimizer state) of :func:`export_state` output
    (the members are restored by the caller, onto any worker count).

    Raises:
        CheckpointError: the checkpoint belongs to another cluster shape or plan.
    """
    check_layout(state, shard_index)  # every field of the types a shard writes (ps_server.checkpoint.checks)
    plan_info = state["plan"]
    if plan_info["num_shards"] != num_shards:
        raise CheckpointError(shard_count_refusal(plan_info["num_shards"], num_shards))
    specs = [ParameterSpec(k, tuple(shape), dtype) for k, shape, dtype in plan_info["specs"]]
    # a checkpoint of an earlier release holds its own cut of the plan (ps_common.plan.plan_for_digest)
    try:
        plan = plan_for_digest(specs, plan_info["num_shards"], plan_info["partition_bytes"], plan_info["digest"])
    except InvalidRequestError:
        raise CheckpointError(
            "The checkpoint's plan digest does not match its specs; it was written by another release of grpc-ps."
        ) from None
    check_tensors(state, plan, shard_index)  # each tensor of the plan's length, dtype, finite
    store = ParameterStore(
        plan,
        shard_index,
        state["tensors"],
        OptimizerSpec(
            state["optimizer"]["name"],
            state["optimizer"]["kwargs"],
            tuple((tuple(keys), dict(kw)) for keys, kw in state["optimizer"].get("groups", [])),
            tuple(state["optimizer"].get("buffers", [])),
        ),
    )
    load_optimizer_state(store, state["optimizer_state"])  # then each tensor checked against its partition
    return plan, store
