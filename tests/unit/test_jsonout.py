"""Every command's JSON is strict: null where a number is not finite, never NaN or Infinity."""

from __future__ import annotations

import json
import math

import pytest

from ps_common.jsonout import dumps, finite_or_none


def strict_loads(text: str) -> object:
    def refuse(constant: str) -> None:
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_become_null_at_any_depth() -> None:
    value = {"a": math.nan, "b": [1.0, math.inf, (-math.inf, 2)], "c": {"d": math.nan, "e": "NaN"}, "f": 3}
    text = dumps(value)
    assert strict_loads(text) == {"a": None, "b": [1.0, None, [None, 2]], "c": {"d": None, "e": "NaN"}, "f": 3}
    assert "NaN" not in text.replace('"NaN"', "") and "Infinity" not in text


def test_finite_values_and_keywords_pass_through() -> None:
    assert finite_or_none(1e308) == 1e308 and finite_or_none(True) is True and finite_or_none(None) is None
    assert dumps({"x": 0.5}, indent=1) == json.dumps({"x": 0.5}, indent=1)


def test_what_json_cannot_represent_still_raises() -> None:
    with pytest.raises(TypeError):
        dumps({"x": object()})
