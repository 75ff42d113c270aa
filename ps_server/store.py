"""Parameter store of one shard: its partitions as flat tensors and a torch.optim optimizer over them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ps_server.core.codec import torch_dtype
from ps_server.core.optimizer import OptimizerSpec
from ps_server.core.plan import PartitionSlice, Plan


class ParameterStore:
    """Owned partitions of one shard, each a 1-D leaf tensor, stepped by one optimizer.

    Args:
        plan: the cluster's plan.
        shard_index: which shard this is.
        values: initial values, one 1-D tensor per owned partition in plan order (copied).
        optimizer: the validated optimizer spec.
    """

    def __init__(self, plan: Plan, shard_index: int, values: Sequence[torch.Tensor], optimizer: OptimizerSpec) -> None:
        self.plan = plan
        self.partitions: tuple[PartitionSlice, ...] = plan.owned_by(shard_index)
        dtypes = {s.key: torch_dtype(s.dtype) for s in plan.specs}
        self.tensors = [
            v.detach().to(dtypes[p.key]).clone().requires_grad_(False)
            for p, v in zip(self.partitions, values, strict=True)
        ]
        self.optimizer_spec = optimizer
        # A shard may own no partition (a model smaller than one partition per shard); torch.optim
        # refuses an empty parameter list, so the spec is then checked on a stand-in tensor.
        self.optimizer = optimizer.build(self.tensors or [torch.zeros(1)])

    @property
    def num_elements(self) -> int:
        return sum(t.numel() for t in self.tensors)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def apply(self, grads: Sequence[torch.Tensor], lr_scale: float = 1.0) -> None:
        """One optimizer step with ``grads`` (one 1-D tensor per partition, plan order).

        Args:
            grads: gradients; cast to each partition's dtype.
            lr_scale: multiplies every group's learning rate for this step only.
        """
        if not self.tensors:
            return
        for t, g in zip(self.tensors, grads, strict=True):
            t.grad = g.to(t.dtype)
        if lr_scale != 1.0:
            saved = [group["lr"] for group in self.optimizer.param_groups]
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * lr_scale
        with torch.no_grad():
            self.optimizer.step()
        if lr_scale != 1.0:
            for group, lr in zip(self.optimizer.param_groups, saved, strict=True):
                group["lr"] = lr
        for t in self.tensors:
            t.grad = None
