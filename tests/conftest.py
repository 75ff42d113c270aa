"""Shared by every test folder: the hypothesis profile, the RPC timeout, a small model, and a run
stopped with SIGTERM ending as one stopped with Ctrl-C.

In-process shards are started by ``start_cluster`` (``tests/integration/conftest.py``)."""

from __future__ import annotations

import signal
import threading
from typing import Any

import pytest
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


def pytest_configure(config: pytest.Config) -> None:
    """A run stopped with SIGTERM (a CI timeout, ``kill``) stops as with Ctrl-C: the running test's
    ``finally`` blocks and every fixture's teardown still run, so the shard and worker processes the
    tests started end with the run instead of living on, orphaned (Python's default for SIGTERM
    ends the process at once). ``tests/integration/test_sigterm.py`` checks it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}: the test run was stopped")
