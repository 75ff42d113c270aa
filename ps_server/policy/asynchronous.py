"""Asynchronous (ASP) updates: each push is one optimizer step at once, with staleness rules.

Staleness of a gradient = shard version now - version the gradient was computed on.
``--max-staleness S`` refuses gradients with staleness > S (the worker pulls and carries on).
``--staleness-lr inverse`` scales the learning rate by ``1 / max(1, staleness)``: the
staleness-dependent learning rate of Zhang, Gupta, Lian, Liu, "Staleness-aware Async-SGD for
Distributed Deep Learning", IJCAI 2016 (section 3, eq. 3).
"""

from __future__ import annotations

from ps_common.errors import StalePushError


def staleness(version_now: int, grad_version: int) -> int:
    """Versions applied since the gradient's parameters were pulled (never negative).

    A gradient claiming a future version is treated as fresh (staleness 0).
    """
    return max(0, version_now - grad_version)


def check_staleness(tau: int, max_staleness: int) -> None:
    """Refuse a gradient that is too old.

    Args:
        tau: the gradient's staleness in versions.
        max_staleness: the bound S; negative means no bound.

    Raises:
        StalePushError: ``tau > max_staleness >= 0``.
    """
    if 0 <= max_staleness < tau:
        raise StalePushError(
            f"Gradient is {tau} versions stale, more than --max-staleness {max_staleness}; "
            "pull the current parameters and compute the next gradient on them."
        )


def lr_scale(tau: int, rule: str) -> float:
    """Learning-rate multiplier for a gradient of staleness ``tau``: ``1 / max(1, tau)`` for
    ``rule == "inverse"`` (Zhang et al. 2016), else 1."""
    return 1.0 / max(1, tau) if rule == "inverse" else 1.0
