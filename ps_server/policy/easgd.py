"""Elastic averaging SGD (EASGD): the center variable and the elastic difference.

Asynchronous EASGD (Zhang, Choromanska, LeCun, "Deep learning with Elastic Averaging SGD",
NIPS 2015, Algorithm 1): every tau local steps a worker sends its parameters x; the shard computes
``d = alpha * (x - center)``, sets ``center += d`` atomically and returns d; the worker sets
``x -= d``. Synchronous EASGD (same paper, eqs. 5-6): all live workers' x of one period are taken
against the same center, ``d_i = alpha * (x_i - center)``, and ``center += sum_i d_i`` summed in
rank order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def elastic_difference(center: Sequence[torch.Tensor], x: Sequence[torch.Tensor], alpha: float) -> list[torch.Tensor]:
    """``d = alpha * (x - center)`` per partition (new tensors; inputs unchanged).

    Args:
        center: 1-D tensors, one per partition.
        x: the worker's values, same shapes.
        alpha: moving rate in (0, 1].
    """
    return [(xi.to(ci.dtype) - ci).mul_(alpha) for ci, xi in zip(center, x, strict=True)]


def exchange(center: Sequence[torch.Tensor], x: Sequence[torch.Tensor], alpha: float) -> list[torch.Tensor]:
    """Async EASGD (Algorithm 1): return d and apply ``center += d`` in place."""
    d = elastic_difference(center, x, alpha)
    for ci, di in zip(center, d, strict=True):
        ci.add_(di)
    return d


def exchange_round(
    center: Sequence[torch.Tensor], xs: Mapping[int, Sequence[torch.Tensor]], alpha: float
) -> dict[int, list[torch.Tensor]]:
    """Sync EASGD (eqs. 5-6): every rank's d against the same center, then ``center += sum d``
    in ascending rank order. Returns rank -> d."""
    ds = {r: elastic_difference(center, xs[r], alpha) for r in sorted(xs)}
    for r in sorted(ds):
        for ci, di in zip(center, ds[r], strict=True):
            ci.add_(di)
    return ds
