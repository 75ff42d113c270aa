"""The full model from every shard, on the worker side: ``state_dict(client)`` and ``pull_into(client, model)``.

Both go through the client's public :meth:`~ps_worker.client.PSClient.pull` (every shard in
parallel, each partition once), so they need an initialized client (``client.init(model, ...)``).
After the workers are gone, ``ps-admin export --out model.pt`` gives the same file (ps_admin.export).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from ps_common.codec import torch_dtype
from ps_common.plan import Plan


class Source(Protocol):
    """What the export reads through (:class:`~ps_worker.client.PSClient`)."""

    @property
    def plan(self) -> Plan | None: ...

    @property
    def version(self) -> int: ...

    def pull(self, out: Mapping[str, torch.Tensor], min_version: int | None = None) -> int: ...


def state_dict(
    client: Source, like: Mapping[str, torch.Tensor] | None = None, min_version: int | None = None
) -> dict[str, torch.Tensor]:
    """Every parameter (and buffer) of the plan as full CPU tensors: what ``torch.save`` writes and
    ``model.load_state_dict`` accepts.

    Args:
        client: an initialized :class:`~ps_worker.client.PSClient` (``plan`` and ``pull`` are used).
        like: key -> tensor whose dtype each entry takes (e.g. ``model.state_dict()``), so integer
            buffers such as BatchNorm's ``num_batches_tracked`` (float64 on the wire) come back as
            int64; keys not in it keep the plan's dtype.
        min_version: as :meth:`PSClient.pull`: default, in sync mode, the round of this worker's
            last push (its own step included); 0 reads whatever each shard holds now.

    Returns:
        key -> contiguous CPU tensor of the parameter's shape, in plan order (parameters first,
        then buffers).

    Raises:
        RuntimeError: the client has no plan yet (call ``client.init(model, ...)`` first).
        grpc.RpcError: a shard refused the pull (see :meth:`PSClient.pull`).
    """
    plan = client.plan
    if plan is None:
        raise RuntimeError("Call client.init(model, optimizer=...) before state_dict(): the plan comes from the model.")
    out = {s.key: torch.empty(s.shape, dtype=torch_dtype(s.dtype)) for s in plan.specs}
    client.pull(out, min_version=min_version)
    if like:
        out = {k: t.to(like[k].dtype) if k in like and like[k].dtype != t.dtype else t for k, t in out.items()}
    return out


def pull_into(client: Source, model: torch.nn.Module, min_version: int | None = None) -> int:
    """Copy the shards' parameters and buffers into ``model`` (any device), in place.

    Args:
        client: an initialized :class:`~ps_worker.client.PSClient`.
        model: a module with the plan's keys and shapes (the one ``client.init`` saw, or a fresh
            copy of its architecture).
        min_version: as :func:`state_dict`.

    Returns:
        The lowest version among the shards.

    Raises:
        KeyError: the plan names a key ``model`` lacks (another architecture).
        ValueError: a shape differs.
        RuntimeError, grpc.RpcError: as :func:`state_dict`.
    """
    own = model.state_dict(keep_vars=True)
    missing = [s.key for s in client.plan.specs if s.key not in own] if client.plan is not None else []
    if missing:
        raise KeyError(f"The model has no {missing[:4]}: pull_into needs the architecture the job trained.")
    values = state_dict(client, like=own, min_version=min_version)
    with torch.no_grad():
        for key, value in values.items():
            target = own[key]
            if target.shape != value.shape:
                raise ValueError(
                    f"{key}: the model's shape {tuple(target.shape)} differs from the job's {tuple(value.shape)}."
                )
            target.copy_(value)
    return client.version
