"""``DistributedOptimizer``: a training loop's step() as push gradients + pull weights."""

from __future__ import annotations

import torch

from ps_worker.client import PSClient


class DistributedOptimizer:
    """Drop-in for a local optimizer: ``step()`` pushes every parameter's ``.grad`` to the shards
    (which run the optimizer) and pulls the updated weights into the model.

    In sync mode the pull waits for the round every live rank joined (BSP); parameters without a
    gradient push zeros.

    Args:
        model: the module whose parameters the client was initialized with.
        client: an initialized :class:`PSClient`.
    """

    def __init__(self, model: torch.nn.Module, client: PSClient) -> None:
        self.model = model
        self.client = client
        self.params = dict(model.named_parameters())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, like ``torch.optim.Optimizer.zero_grad``."""
        self.model.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> int:
        """Push gradients, pull weights.

        Returns:
            The version pulled (sync: the round number after this step).

        Raises:
            grpc.RpcError: see :meth:`PSClient.push` and :meth:`PSClient.pull`.
        """
        grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in self.params.items()}
        self.client.push(grads)
        return self.client.pull({k: p.data for k, p in self.params.items()})
