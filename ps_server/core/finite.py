"""A cheap test that tensors hold no inf or NaN, for checking the result of an update."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when no floating tensor of ``tensors`` holds inf or NaN.

    One summing pass per tensor: a sum is finite only if every element is, and costs about half of
    ``isfinite().all()`` (no boolean temporary). Only a sum that overflows from finite values pays
    the exact check as well.
    """
    for t in tensors:
        if not t.is_floating_point() or t.numel() == 0:
            continue
        total = t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()
        if not math.isfinite(total.item()) and not bool(torch.isfinite(t).all()):
            return False
    return True
