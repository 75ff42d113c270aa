"""Refused data connections: counted each, and logged at WARNING at a bounded rate."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable


class RateLimitedWarnings:
    """WARNING lines at most once per ``seconds``; the lines held back are counted and their
    number is appended to the next line logged.

    Args:
        logger: where the lines go.
        seconds: the shortest interval between two lines.
        now: monotonic clock in seconds.
    """

    def __init__(self, logger: logging.Logger, seconds: float, now: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._seconds = seconds
        self._now = now
        self._next = -math.inf
        self._held = 0
        self._lock = threading.Lock()

    def warning(self, message: str, *args: object) -> bool:
        """Log ``message % args`` unless a line went out less than ``seconds`` ago; returns
        whether it was logged."""
        with self._lock:
            now = self._now()
            if now < self._next:
                self._held += 1
                return False
            held, self._held, self._next = self._held, 0, now + self._seconds
        more = f" ({held} more refused in the last {self._seconds:g} s, not logged)" if held else ""
        self._log.warning(message + "%s", *args, more)
        return True


class Refusals:
    """The refusals of one shard's data connections (wrong token, a rank outside the cluster or not
    a live member, over a bound): each is counted and its line goes to ``warnings``.

    Args:
        counted: called once per refusal (the shard's ``rejected`` counter).
        warnings: where the lines go, at a bounded rate.
    """

    def __init__(self, counted: Callable[[], None], warnings: RateLimitedWarnings) -> None:
        self._counted = counted
        self._warnings = warnings

    def refuse(self, message: str, *args: object) -> None:
        """Count one refusal and log ``message % args`` (unless rate-limited)."""
        self._counted()
        self._warnings.warning(message, *args)
