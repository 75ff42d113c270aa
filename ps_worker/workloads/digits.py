"""``digits``: an MLP on scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes).

The data ships inside scikit-learn, so no download is needed. 20% is held out (stratified,
``random_state=0``); pixels are scaled from 0..16 to 0..1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import Dataset, TensorDataset


class DigitsWorkload:
    """MLP 64 -> 128 -> 10 with ReLU; cross-entropy loss; held-out accuracy."""

    name = "digits"
    hidden = 128

    def model(self) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(64, self.hidden), torch.nn.ReLU(), torch.nn.Linear(self.hidden, 10))

    def datasets(self) -> tuple[Dataset, Dataset]:
        x, y = load_digits(return_X_y=True)
        x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)

        def tensors(a, b) -> TensorDataset:  # noqa: ANN001 - numpy arrays
            return TensorDataset(torch.tensor(a / 16.0, dtype=torch.float32), torch.tensor(b, dtype=torch.long))

        return tensors(x_train, y_train), tensors(x_test, y_test)

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, held_out: Dataset) -> dict[str, float]:
        assert isinstance(held_out, TensorDataset)
        x, y = held_out.tensors
        logits = model(x)
        return {
            "accuracy": float((logits.argmax(1) == y).float().mean()),
            "loss": float(F.cross_entropy(logits, y)),
        }
