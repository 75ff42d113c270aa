"""``DistributedOptimizer``: a training loop's ``step()`` in every consistency model."""

from __future__ import annotations

import functools
import logging

import torch

from ps_worker.client import PendingPushPull, PSClient

log = logging.getLogger(__name__)


class DistributedOptimizer:
    """Drop-in for a local optimizer.

    - sync, async, ssp: ``step()`` pushes every parameter's ``.grad`` (the shards run the
      optimizer) and pulls the updated weights, in one PushPull call per shard. Sync pulls wait
      for the round (BSP); ssp pulls wait while this rank is more than s clocks ahead of the
      slowest; async pulls never wait. A push the shards refuse as too stale (ABORTED) is counted
      in ``client.refused_pushes``, the weights are pulled, and training carries on.
    - easgd: ``step()`` runs ``local_optimizer``; every tau-th step it exchanges with the center
      (Zhang, Choromanska, LeCun 2015, Algorithm 1).

    Parameters without a gradient push zeros.

    Args:
        model: the module whose parameters the client was initialized with.
        client: an initialized :class:`PSClient`.
        local_optimizer: required in easgd mode (e.g. ``torch.optim.SGD(model.parameters(), lr=0.1)``);
            ignored otherwise.
        overlap: push each parameter's gradient while backward still runs (sync, async, ssp):
            autograd hooks (``register_post_accumulate_grad_hook``) hand every finished gradient to
            a :class:`~ps_worker.client.PendingPushPull`, whose streams send each message as soon
            as its partitions are ready; ``step()`` then only finishes the call. Assumes one
            backward per step (no gradient accumulation over several backward passes).

    Raises:
        ValueError: easgd mode without a local optimizer.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        client: PSClient,
        local_optimizer: torch.optim.Optimizer | None = None,
        *,
        overlap: bool = False,
    ) -> None:
        if client.mode == "easgd" and local_optimizer is None:
            raise ValueError("This cluster runs easgd: pass local_optimizer=torch.optim.SGD(model.parameters(), ...).")
        self.model = model
        self.client = client
        self.local_optimizer = local_optimizer
        self.params = dict(model.named_parameters())
        self.local_steps = 0
        self.overlap = overlap
        self._pending: PendingPushPull | None = None
        if overlap:  # the hooks stay; setting ``overlap`` to False later turns them into no-ops
            for key, p in self.params.items():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, key))

    def _grad_ready(self, key: str, param: torch.Tensor) -> None:
        """Autograd hook: ``param``'s gradient is final for this backward pass."""
        if param.grad is None or not self.overlap or self.client.mode == "easgd":
            return
        if self._pending is None:
            self._pending = self.client.begin_push_pull({k: p.data for k, p in self.params.items()})
        self._pending.ready(key, param.grad)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, like ``torch.optim.Optimizer.zero_grad``."""
        self.model.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> int:
        """One training step.

        Returns:
            The version the model now holds (sync: the round number after this step).

        Raises:
            grpc.RpcError: see :meth:`PSClient.push_pull` and :meth:`PSClient.exchange`.
        """
        values = {k: p.data for k, p in self.params.items()}
        if self.client.mode == "easgd":
            assert self.local_optimizer is not None
            self.local_optimizer.step()
            self.local_steps += 1
            period = max(1, self.client.config.communication_period)
            if self.local_steps % period == 0:
                return self.client.exchange(values)
            return self.client.version
        if self._pending is not None:  # overlap: the pushes began during backward
            pending, self._pending = self._pending, None
            return pending.finish()
        grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in self.params.items()}
        return self.client.push_pull(grads, values)
