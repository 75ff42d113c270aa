"""Options of the chaos soak: how long faults are injected, and the seed of their sequence.

``--soak-seconds S`` (or ``PS_SOAK_SECONDS``; the flag wins) sets the fault window, default
:data:`DEFAULT_SOAK_SECONDS`; the test's pytest timeout grows with it. ``PS_SOAK_SEED`` fixes the
seed (default: a fresh one, printed in the report so that a failure can be replayed).
"""

from __future__ import annotations

import os

import pytest

DEFAULT_SOAK_SECONDS = 50.0
"""Fault window of a default (CI) run (the periodic and async runs take half); the three runs then
take about 3 minutes."""

OVERHEAD_SECONDS = 280.0
"""Start-up (up to 150 s), the fault-free end of the job (110 s) and teardown, on top of the window
(pytest timeout)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-seconds",
        type=float,
        default=None,
        help=f"chaos soak: seconds of fault injection (env PS_SOAK_SECONDS; default {DEFAULT_SOAK_SECONDS:g})",
    )


def soak_seconds(config: pytest.Config) -> float:
    """The fault window: the flag, else ``PS_SOAK_SECONDS``, else the default."""
    value = config.getoption("--soak-seconds", default=None)  # None also when this conftest loaded late
    if value is None:
        value = float(os.environ.get("PS_SOAK_SECONDS", DEFAULT_SOAK_SECONDS))
    if value <= 0:
        raise pytest.UsageError(f"--soak-seconds must be > 0, got {value:g}")
    return float(value)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The soak's pytest timeout: its window plus the start-up and the end of the job."""
    limit = soak_seconds(config) + OVERHEAD_SECONDS
    for item in items:
        if item.nodeid.startswith("tests/chaos/"):
            item.add_marker(pytest.mark.timeout(limit))


@pytest.fixture
def soak_window(pytestconfig: pytest.Config) -> float:
    """Seconds of fault injection for this run."""
    return soak_seconds(pytestconfig)


@pytest.fixture
def soak_seed() -> int:
    """The fault sequence's seed: ``PS_SOAK_SEED`` or a fresh one."""
    raw = os.environ.get("PS_SOAK_SEED")
    return int(raw) if raw else int.from_bytes(os.urandom(4), "little")
