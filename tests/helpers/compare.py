"""Bitwise comparison of nested states (dicts, lists, tuples, tensors, scalars)."""

from __future__ import annotations

from typing import Any

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` as a 1-D uint8 tensor (NaN-safe, so equality is bitwise)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_identical(a: Any, b: Any, where: str = "state") -> None:
    """Same structure, same types, tensors bitwise equal with the same dtype and shape."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(bits(a), bits(b)), f"{where}: tensor contents differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
