"""The consistency model in force and its parameters (DESIGN section 5), validated."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ps_common.errors import InvalidRequestError
from ps_common.text import quote

MODES = ("async", "easgd", "ssp", "sync")
STALENESS_LR_RULES = ("", "inverse")

MAX_COUNT = 2**31 - 1
"""Largest staleness bound and communication period, in clocks and steps. A negative number sent in
a uint32 field arrives as 2**32 - n: far above it, refused instead of read as a huge bound."""


def _count(flag: str, value: int, low: int, unit: str) -> None:
    if not low <= value <= MAX_COUNT:
        wrapped = f" ({value - 2**32} sent as an unsigned 32-bit integer?)" if 2**31 <= value < 2**32 else ""
        raise InvalidRequestError(f"{flag} must be in {low}..{MAX_COUNT} {unit}, got {value}{wrapped}.")


@dataclass(frozen=True)
class ModeSettings:
    """Mode and parameters of a cluster.

    Attributes:
        mode: one of :data:`MODES`.
        num_workers: ranks in the cluster (for defaults and bounds).
        sync_quorum: sync: close a round after the first K pushes; 0 means every live rank.
        round_timeout: sync: seconds after which missing ranks of an open round are reported; 0 = never.
        max_staleness: async: refuse gradients more than S versions old; -1 = no bound.
        staleness_lr: async: "inverse" scales the learning rate by 1/max(1, staleness).
        staleness: ssp: the bound s in clocks.
        moving_rate: easgd: alpha; None means 0.9 / num_workers (Zhang et al. 2015, section 5).
        communication_period: easgd: tau, local steps between exchanges.
        easgd_sync: easgd: apply one period's exchanges together in rank order.

    Raises:
        InvalidRequestError: a value out of range, in a full sentence.
    """

    mode: str = "sync"
    num_workers: int = 1
    sync_quorum: int = 0
    round_timeout: float = 0.0
    max_staleness: int = -1
    staleness_lr: str = ""
    staleness: int = 0
    moving_rate: float | None = None
    communication_period: int = 10
    easgd_sync: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidRequestError(f"Unknown mode {quote(self.mode)}; expected one of {', '.join(MODES)}.")
        if not 0 <= self.sync_quorum <= self.num_workers:
            raise InvalidRequestError(
                f"--sync-quorum must be in 0..{self.num_workers} (0 = every live rank), got {self.sync_quorum}."
            )
        if not (math.isfinite(self.round_timeout) and self.round_timeout >= 0):
            raise InvalidRequestError(f"--round-timeout must be >= 0 seconds, got {self.round_timeout}.")
        if self.max_staleness < -1:
            raise InvalidRequestError(f"--max-staleness must be >= 0 (or -1 for no bound), got {self.max_staleness}.")
        if self.staleness_lr not in STALENESS_LR_RULES:
            raise InvalidRequestError(f"--staleness-lr must be 'inverse' or empty, got {quote(self.staleness_lr)}.")
        _count("--staleness", self.staleness, 0, "clocks")
        if self.moving_rate is not None and not (0 < self.moving_rate <= 1):
            raise InvalidRequestError(f"--moving-rate must be in (0, 1], got {self.moving_rate}.")
        _count("--communication-period", self.communication_period, 1, "steps")

    @property
    def alpha(self) -> float:
        """The EASGD moving rate in force: ``moving_rate`` or 0.9 / num_workers."""
        return self.moving_rate if self.moving_rate is not None else 0.9 / self.num_workers

    @property
    def quorum(self) -> int:
        """Pushes that close a sync round (0 = every expected rank)."""
        return self.sync_quorum

    def updated(self, **changes: Any) -> ModeSettings:
        """A copy with ``changes`` applied and validated.

        Raises:
            InvalidRequestError: an invalid value, or a switch into or out of easgd (workers run a
                different loop there; restart the cluster instead).
        """
        new = dataclasses.replace(self, **changes)
        if (new.mode == "easgd") != (self.mode == "easgd"):
            raise InvalidRequestError(
                f"Cannot switch from {self.mode} to {new.mode} live: EASGD workers run local optimizers; "
                "restart the cluster with the new --mode."
            )
        return new
