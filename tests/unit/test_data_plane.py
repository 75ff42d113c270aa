"""The data plane's pure parts: refusal warnings at a bounded rate, and the parked-frame settings."""

from __future__ import annotations

import logging

import pytest

from ps_common.errors import InvalidRequestError
from ps_server.config import ServerConfig, config_from_args
from ps_server.dataplane.connections import RateLimitedWarnings

BASE = ["--shard-index", "0", "--num-shards", "1", "--num-workers", "1"]


def test_warnings_are_rate_limited_and_count_what_they_held_back(caplog: pytest.LogCaptureFixture) -> None:
    clock = [100.0]
    warnings = RateLimitedWarnings(logging.getLogger("test.refusals"), 10.0, now=lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        assert warnings.warning("refused rank %d", 1)
        assert not any(warnings.warning("refused rank %d", r) for r in range(2, 50))  # 48 held back
        clock[0] += 10.0
        assert warnings.warning("refused rank %d", 50)
        assert not warnings.warning("refused rank %d", 51)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused rank 1", "refused rank 50 (48 more refused in the last 10 s, not logged)"]


def test_frame_timeout_defaults_to_three_lease_timeouts_and_has_a_flag_and_twin() -> None:
    config, _ = config_from_args([*BASE, "--lease-timeout", "4"], environ={})
    assert (config.frame_timeout, config.max_parked_bytes) == (12.0, 0)
    config, _ = config_from_args(BASE, environ={"PS_DATA_FRAME_TIMEOUT": "0.5", "PS_MAX_PARKED_BYTES": "4096"})
    assert (config.frame_timeout, config.max_parked_bytes) == (0.5, 4096)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"data_frame_timeout": -1.0}, "--data-frame-timeout must be in 0..86400"),
        ({"data_frame_timeout": float("nan")}, "--data-frame-timeout must be in 0..86400"),
        ({"max_parked_bytes": -1}, "--max-parked-bytes must be >= 0"),
    ],
)
def test_bad_parked_frame_settings_are_refused(kwargs, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        ServerConfig(shard_index=0, num_shards=1, num_workers=1, **kwargs)
