"""The interface of a built-in workload."""

from __future__ import annotations

from typing import Protocol

import torch
from torch.utils.data import Dataset


class Workload(Protocol):
    """A model, a training set, a held-out set and a loss."""

    name: str

    def model(self) -> torch.nn.Module:
        """A freshly initialized model (call under a fixed ``torch.manual_seed``)."""
        ...

    def datasets(self) -> tuple[Dataset, Dataset]:
        """(train, held-out), each yielding ``(x, y)`` pairs; deterministic."""
        ...

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Scalar training loss of one batch."""
        ...

    def evaluate(self, model: torch.nn.Module, held_out: Dataset) -> dict[str, float]:
        """Held-out metrics, e.g. ``{"accuracy": 0.97, "loss": 0.1}``."""
        ...
