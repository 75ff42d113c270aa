"""What of a model a plan carries, and the optimizer spec rank 0 sends at Init
(docs/architecture.md#6-partition-plan, docs/architecture.md#9-worker-library)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ps_common.codec import dtype_name
from ps_common.optimizer import OptimizerSpec
from ps_common.plan import ParameterSpec, Plan, make_plan


def model_specs(named: Sequence[tuple[str, torch.Tensor]]) -> list[ParameterSpec]:
    """Specs of ``model.named_parameters()``, in declaration order.

    Raises:
        InvalidRequestError: a dtype grpc-ps does not transport.
    """
    return [ParameterSpec(k, tuple(t.shape), dtype_name(t.dtype)) for k, t in named]


def named_and_spec(
    model: torch.nn.Module, optimizer: Mapping[str, Any] | None, buffers: bool
) -> tuple[list[tuple[str, torch.Tensor]], OptimizerSpec]:
    """The tensors of the plan (parameters, then buffers if ``buffers``) and the optimizer spec.

    Raises:
        ValueError: optimizer groups name keys that are not parameters of the model.
    """
    spec = dict(optimizer or {"name": "sgd", "lr": 0.1})
    groups = tuple(
        (tuple(str(key) for key in g["params"]), {k: float(v) for k, v in g.items() if k != "params"})
        for g in spec.pop("groups", ())
    )
    named: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    if buffers:
        named += [(k, b) for k, b in model.named_buffers() if b is not None]
    buffer_keys = tuple(k for k, _ in named[len(list(model.parameters())) :])
    opt = OptimizerSpec(str(spec.pop("name")), {k: float(v) for k, v in spec.items()}, groups, buffer_keys)
    unknown = sorted({k for keys, _ in groups for k in keys} - {k for k, _ in named})
    if unknown:
        raise ValueError(f"Optimizer groups name {unknown[:4]}, which are not parameters of the model.")
    return named, opt


def model_plan(
    model: torch.nn.Module, optimizer: Mapping[str, Any] | None, buffers: bool, num_shards: int, partition_bytes: int
) -> tuple[list[tuple[str, torch.Tensor]], OptimizerSpec, Plan]:
    """:func:`named_and_spec`, and the plan of those tensors (integer buffers travel as float64).

    Raises:
        ValueError: as :func:`named_and_spec`. InvalidRequestError: an unsupported dtype.
    """
    named, opt = named_and_spec(model, optimizer, buffers)
    specs = model_specs([(k, t if t.is_floating_point() else t.to(torch.float64)) for k, t in named])
    return named, opt, make_plan(specs, num_shards, partition_bytes)
