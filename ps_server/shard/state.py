"""A shard's state as plain data for checkpoints: what :meth:`Shard.export_state` writes
(:func:`snapshot`) and :meth:`Shard.restore` reads (:func:`resume`); ``torch.load(weights_only=True)``
reads it: no pickled objects."""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ps_common.errors import CheckpointError, NotInitializedError
from ps_common.optimizer import OptimizerSpec
from ps_common.plan import ParameterSpec, Plan, make_plan, plan_digest
from ps_server.policy.sync import SyncRounds
from ps_server.shard import members as shard_members
from ps_server.shard import round_stream
from ps_server.shard.store import ParameterStore

if TYPE_CHECKING:
    from ps_server.membership.ranks import Membership
    from ps_server.shard.shard import Shard

log = logging.getLogger("ps_server.shard.shard")


def snapshot(shard: Shard) -> dict[str, Any]:
    """Everything a restarted ``shard`` needs, as plain data: plan, parameter tensors (copies),
    optimizer spec and state, version, mode, members, membership epochs, tables. Taken under the
    shard's lock; a streamed round's speculative partitions are put back first.

    Raises:
        NotInitializedError: nothing to save yet.
    """
    with shard._cond:
        if shard.plan is None or shard.store is None:
            raise NotInitializedError(f"Shard {shard.shard_index} has nothing to checkpoint before Init.")
        rounds = shard.rounds
        if rounds.pending:
            log.info(
                "shard %d: snapshot at version %d leaves out the open round's pushes from ranks %s",
                shard.shard_index,
                shard.version,
                sorted(rounds.pending),
            )
        round_stream.end(shard, "a checkpoint needed the parameters mid-round")
        # the open round's held pushes are not in the snapshot: neither are their traces in the
        # members (a remembered answer would make the rank's push again a duplicate after a restart)
        held = dict.fromkeys(rounds.pending, rounds.round)
        state = export_state(shard.plan, shard.store, shard.version, shard.mode, shard.membership, held)
        state["epochs"] = shard.epochs.export()
        state["configured_num_workers"] = shard.configured_num_workers
        if shard.tables.tables:
            state["tables"] = shard.tables.export()
        return state


def resume(shard: Shard, state: dict[str, Any]) -> None:
    """Resume ``shard`` from :func:`snapshot` output: parameters, optimizer state, version and
    members (live ranks get a fresh lease to come back in).

    Raises:
        CheckpointError: the checkpoint belongs to another cluster shape or plan.
    """
    plan, store = load_state(state, shard.shard_index, shard.num_shards)
    with shard._cond:
        shard.plan, shard.store = plan, store
        shard.stream = None
        shard._store_epoch += 1
        shard.version = int(state["version"])
        shard.rounds = SyncRounds(round=shard.version)
        shard.membership.restore(state["members"])
        shard.epochs.restore(state.get("epochs"))
        shard.tables.restore(state.get("tables"))
        shard_members.restored(shard, state)
        shard.restored_from_version = shard.version
        shard.last_checkpoint_version = shard.version
        log.info("shard %d: resumed from its checkpoint at version %d", shard.shard_index, shard.version)
        shard._cond.notify_all()


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


def load_state(state: dict[str, Any], shard_index: int, num_shards: int) -> tuple[Plan, ParameterStore]:
    """The plan and the store (parameters and optimizer state) of :func:`export_state` output
    (the members are restored by the caller, onto any worker count).

    Raises:
        CheckpointError: the checkpoint belongs to another cluster shape or plan.
    """
    plan_info = state["plan"]
    if plan_info["num_shards"] != num_shards:
        raise CheckpointError(
            f"The checkpoint is of a cluster with {plan_info['num_shards']} shards, but this shard runs with "
            f"{num_shards}; start with the same --num-shards or another --checkpoint-dir (the shard count "
            "of a job is fixed; its worker count is not)."
        )
    specs = [ParameterSpec(k, tuple(shape), dtype) for k, shape, dtype in plan_info["specs"]]
    plan = make_plan(specs, plan_info["num_shards"], plan_info["partition_bytes"])
    # a checkpoint of a release before the packing version joined the digest holds the same plan
    legacy = plan_digest(specs, plan.num_shards, plan.partition_bytes, packing=0)
    if plan_info["digest"] not in (plan.digest, legacy):
        raise CheckpointError(
            "The checkpoint's plan digest does not match its specs; it was written by another release of grpc-ps."
        )
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
    store.optimizer.load_state_dict(state["optimizer_state"])
    return plan, store
