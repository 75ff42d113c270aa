"""A valid checkpoint set of a small job, built without a shard or a socket (for the tests of what
restore and ``ps-admin reshard`` refuse): every shard's state at one version, as a shard writes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ps_common.optimizer import OptimizerSpec
from ps_common.plan import ParameterSpec, make_plan
from ps_server.checkpoint.files import CheckpointStore
from ps_server.shard.store import ParameterStore

SPECS = (ParameterSpec("fc.weight", (16, 32), "float32"), ParameterSpec("fc.bias", (16,), "float32"))
PARTITION_BYTES = 256
VERSION = 5


def job_states(num_shards: int, version: int = VERSION) -> list[dict[str, Any]]:
    """Each shard's checkpoint state of a job of ``num_shards`` shards that took one Adam step."""
    plan = make_plan(SPECS, num_shards, PARTITION_BYTES)
    spec = OptimizerSpec("adam", {"lr": 0.01})
    whole = {s.key: torch.linspace(-1, 1, s.numel) for s in SPECS}
    states = []
    for k in range(num_shards):
        owned = plan.owned_by(k)
        store = ParameterStore(plan, k, [whole[p.key][p.offset : p.offset + p.length] for p in owned], spec)
        for t in store.trained:
            t.grad = torch.full_like(t, 0.5)
        if store.trained:
            store.optimizer.step()
        states.append(
            {
                "plan": {
                    "specs": [[s.key, list(s.shape), s.dtype] for s in plan.specs],
                    "num_shards": num_shards,
                    "partition_bytes": PARTITION_BYTES,
                    "digest": plan.digest,
                },
                "tensors": [t.detach().clone() for t in store.tensors],
                "optimizer": {"name": "adam", "kwargs": {"lr": 0.01}, "groups": [], "buffers": []},
                "optimizer_state": store.optimizer.state_dict(),
                "version": version,
                "mode": "sync",
                "members": [
                    {
                        "rank": 0,
                        "incarnation": 1,
                        "clock": version,
                        "pushes": version,
                        "high_water": version,
                        "state": "live",
                    }
                ],
            }
        )
    return states


def write_set(directory: Path, states: list[dict[str, Any]], version: int = VERSION) -> None:
    """Write ``states`` as the checkpoint files of ``directory`` (valid envelopes and digests)."""
    for k, state in enumerate(states):
        CheckpointStore(directory, k, keep=3).save(state, version)
