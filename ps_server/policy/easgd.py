"""Elastic averaging SGD (EASGD): the center variable and the elastic difference.

Asynchronous EASGD (Zhang, Choromanska, LeCun, "Deep learning with Elastic Averaging SGD",
NIPS 2015, Algorithm 1): every tau local steps a worker sends its parameters x; the shard computes
``d = alpha * (x - center)``, sets ``center += d`` atomically and returns d; the worker sets
``x -= d``. Synchronous EASGD (same paper, eqs. 5-6): all live workers' x of one period are taken
against the same center, ``d_i = alpha * (x_i - center)``, and ``center += sum_i d_i`` summed in
rank order.

Both are all or nothing: when the new center (or a d) would hold inf or NaN, although x was finite
(``x - center`` overflows), nothing changes and :class:`NonFiniteUpdateError` is raised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ps_common.errors import NonFiniteUpdateError
from ps_server.core.finite import all_finite


def elastic_difference(center: Sequence[torch.Tensor], x: Sequence[torch.Tensor], alpha: float) -> list[torch.Tensor]:
    """``d = alpha * (x - center)`` per partition (new tensors; inputs unchanged).

    Args:
        center: 1-D tensors, one per partition.
        x: the worker's values, same shapes.
        alpha: moving rate in (0, 1].
    """
    return [(xi.to(ci.dtype) - ci).mul_(alpha) for ci, xi in zip(center, x, strict=True)]


def _commit(center: Sequence[torch.Tensor], new: Sequence[torch.Tensor], ds: Sequence[torch.Tensor]) -> None:
    """Copy ``new`` into ``center`` when it and every d are finite.

    Raises:
        NonFiniteUpdateError: otherwise; ``center`` is unchanged.
    """
    if not (all_finite(new) and all_finite(ds)):
        raise NonFiniteUpdateError(
            "The exchange would make the center non-finite (inf or NaN): x - center overflows; it was refused and "
            "the center is unchanged."
        )
    for ci, ni in zip(center, new, strict=True):
        ci.copy_(ni)


def exchange(center: Sequence[torch.Tensor], x: Sequence[torch.Tensor], alpha: float) -> list[torch.Tensor]:
    """Async EASGD (Algorithm 1): return d and apply ``center += d`` in place.

    Raises:
        NonFiniteUpdateError: d or the new center would not be finite; nothing changed.
    """
    d = elastic_difference(center, x, alpha)
    _commit(center, [ci + di for ci, di in zip(center, d, strict=True)], d)
    return d


def exchange_round(
    center: Sequence[torch.Tensor], xs: Mapping[int, Sequence[torch.Tensor]], alpha: float
) -> dict[int, list[torch.Tensor]]:
    """Sync EASGD (eqs. 5-6): every rank's d against the same center, then ``center += sum d``
    in ascending rank order. Returns rank -> d.

    Raises:
        NonFiniteUpdateError: a d or the new center would not be finite; nothing changed.
    """
    ds = {r: elastic_difference(center, xs[r], alpha) for r in sorted(xs)}
    new = [ci.clone() for ci in center]
    for r in sorted(ds):
        for ni, di in zip(new, ds[r], strict=True):
            ni.add_(di)
    _commit(center, new, [di for r in sorted(ds) for di in ds[r]])
    return ds
