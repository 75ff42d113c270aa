"""``linreg``: noiseless linear regression, y = x w* + b* with x ~ N(0, I_16).

The exact solution has zero loss, so the final held-out MSE measures optimization alone: the
sync-mode scaling check (1, 2, 4, 8 workers all reach MSE <= 1e-6) uses it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

FEATURES = 16


class LinRegWorkload:
    """``torch.nn.Linear(16, 1)`` on 4,096 training and 1,024 held-out samples (float32)."""

    name = "linreg"

    def model(self) -> torch.nn.Module:
        return torch.nn.Linear(FEATURES, 1)

    def datasets(self) -> tuple[Dataset, Dataset]:
        g = torch.Generator().manual_seed(1234)
        w = torch.randn(FEATURES, 1, generator=g)
        b = torch.randn(1, generator=g)
        x = torch.randn(4096 + 1024, FEATURES, generator=g)
        y = x @ w + b
        return TensorDataset(x[:4096], y[:4096]), TensorDataset(x[4096:], y[4096:])

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, held_out: Dataset) -> dict[str, float]:
        assert isinstance(held_out, TensorDataset)
        x, y = held_out.tensors
        return {"loss": float(F.mse_loss(model(x), y))}
