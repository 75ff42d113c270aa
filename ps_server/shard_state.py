"""A shard's state as plain data for checkpoints: what :meth:`Shard.export_state` writes and
:meth:`Shard.restore` reads (``torch.load(weights_only=True)`` reads it: no pickled objects)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ps_common.errors import CheckpointError
from ps_common.optimizer import OptimizerSpec
from ps_common.plan import ParameterSpec, Plan, make_plan, plan_digest
from ps_server.store import ParameterStore

if TYPE_CHECKING:
    from ps_server.membership import Membership


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
