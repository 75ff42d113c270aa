"""Shared by every test folder: the hypothesis profile, the RPC timeout and a small model.

In-process shards are started by ``start_cluster`` (``tests/integration/conftest.py``)."""

from __future__ import annotations

import torch
from hypothesis import settings

# Property tests check behaviour, not speed: a loaded 2-core CI machine must not fail them on time.
settings.register_profile("grpc-ps", deadline=None)
settings.load_profile("grpc-ps")

RPC_TIMEOUT = 10.0
"""Seconds every RPC in a test may take; a barrier bug fails instead of hanging."""


def small_model(seed: int = 0) -> torch.nn.Module:
    """MLP 8 -> 16 -> 3 (195 parameters), seeded."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
