"""Fixtures of the adversarial tests: a hostile or unlucky client against real shards over gRPC.

The same in-process shards, trainers and pollers as the integration tests (``tests/integration``),
so every request and wait here is bounded in the same way.
"""

from __future__ import annotations

from tests.integration.conftest import (
    Trainer,
    poll,
    start_cluster,
    start_module_cluster,
    start_trainer,
    tool,
    wait_until,
)

__all__ = ["Trainer", "poll", "start_cluster", "start_module_cluster", "start_trainer", "tool", "wait_until"]
