"""The partition plan: deterministic, complete, balanced, bounded by partition_bytes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ps_server.core.errors import InvalidRequestError
from ps_server.core.plan import ParameterSpec, make_plan

SPECS = (
    ParameterSpec("fc1.weight", (128, 64), "float32"),
    ParameterSpec("fc1.bias", (128,), "float32"),
    ParameterSpec("fc2.weight", (10, 128), "float32"),
    ParameterSpec("fc2.bias", (10,), "float32"),
)


def test_plan_is_a_pure_function_with_a_stable_digest() -> None:
    a = make_plan(SPECS, 2, 4096)
    b = make_plan(list(SPECS), 2, 4096)
    assert a == b
    assert a.digest == b.digest and len(a.digest) == 64
    assert make_plan(SPECS, 3, 4096).digest != a.digest
    assert make_plan(SPECS, 2, 8192).digest != a.digest
    assert make_plan(SPECS[::-1], 2, 4096).digest != a.digest


def test_partitions_respect_partition_bytes_and_cover_every_element() -> None:
    plan = make_plan(SPECS, 2, 4096)
    for spec in SPECS:
        parts = [p for p in plan.partitions if p.key == spec.key]
        assert parts[0].offset == 0
        for prev, nxt in zip(parts, parts[1:], strict=False):
            assert prev.offset + prev.length == nxt.offset
        assert parts[-1].offset + parts[-1].length == spec.numel
        assert all(p.length * 4 <= 4096 for p in parts)


def test_least_loaded_assignment_balances_bytes() -> None:
    plan = make_plan(SPECS, 2, 4096)
    loads = plan.shard_bytes()
    assert sum(loads) == sum(s.numel * 4 for s in SPECS)
    assert max(loads) - min(loads) <= 4096


def test_one_huge_parameter_spreads_over_every_shard() -> None:
    plan = make_plan([ParameterSpec("w", (4096, 4096), "float32")], 2)
    assert {p.shard for p in plan.partitions} == {0, 1}
    assert len(plan.partitions) == 16  # 64 MiB in 4 MiB partitions


@pytest.mark.parametrize(
    ("specs", "shards", "pbytes", "message"),
    [
        ([], 2, 4096, "no parameters"),
        ([ParameterSpec("a", (2,), "float32")] * 2, 2, 4096, "appears twice"),
        ([ParameterSpec("a", (0, 3), "float32")], 2, 4096, "empty"),
        ([ParameterSpec("a", (2,), "int8")], 2, 4096, "Unsupported dtype"),
        ([ParameterSpec("a", (2,), "float32")], 0, 4096, "num_shards"),
        ([ParameterSpec("a", (2,), "float32")], 1, 0, "partition_bytes"),
    ],
)
def test_bad_specs_are_refused_with_a_reason(specs, shards, pbytes, message) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        make_plan(specs, shards, pbytes)


@given(
    shapes=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=3), min_size=1, max_size=6),
    shards=st.integers(1, 5),
    pbytes=st.integers(4, 512),
)
def test_every_element_is_owned_exactly_once(shapes, shards, pbytes) -> None:
    specs = [ParameterSpec(f"p{i}", tuple(s), "float32") for i, s in enumerate(shapes)]
    plan = make_plan(specs, shards, pbytes)
    for spec in specs:
        covered = sorted((p.offset, p.length) for p in plan.partitions if p.key == spec.key)
        end = 0
        for offset, length in covered:
            assert offset == end and length >= 1
            end += length
        assert end == spec.numel
    assert sorted(p for k in range(shards) for p in plan.owned_by(k)) == sorted(plan.partitions)
