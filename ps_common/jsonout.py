"""Strict JSON for every command's machine-readable output (RFC 8259: no NaN or Infinity).

``json.dumps`` writes ``NaN`` and ``Infinity`` by default, which ``jq``, JavaScript and most JSON
parsers refuse; a value that is not a finite number is written as ``null`` instead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


def finite_or_none(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, +-inf) replaced by None, through dicts, lists and
    tuples (tuples become lists, as JSON has no tuple); other values unchanged."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`finite_or_none` of ``value`` with ``allow_nan=False``: always valid
    JSON, with ``null`` where a number is not finite.

    Raises:
        TypeError: a value JSON cannot represent (as ``json.dumps``).
    """
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)
