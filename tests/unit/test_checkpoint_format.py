"""The checkpoint file format: the digest covers values, types and order (the envelope on disk is
tested through the store in test_checkpoint.py)."""

from __future__ import annotations

import torch

from ps_server.checkpoint.format import digest


def test_digest_covers_values_types_and_order() -> None:
    base = {"a": [1, 2.0, "x"], "t": torch.zeros(2)}
    same = {"a": [1, 2.0, "x"], "t": torch.zeros(2)}
    assert digest(base) == digest(same)
    for other in (
        {"a": [1, 2.0, "x"], "t": torch.zeros(2, dtype=torch.float64)},  # dtype
        {"a": [1, 2.0, "x"], "t": torch.zeros(1, 2)},  # shape
        {"a": [1, 2.0, "x"], "t": torch.tensor([0.0, -0.0])},  # one bit
        {"a": [1.0, 2.0, "x"], "t": torch.zeros(2)},  # int vs float
        {"a": (1, 2.0, "x"), "t": torch.zeros(2)},  # list vs tuple
        {"t": torch.zeros(2), "a": [1, 2.0, "x"]},  # key order (pickle keeps it)
        {"a": [1, 2.0, "x", None], "t": torch.zeros(2)},
    ):
        assert digest(other) != digest(base), other
