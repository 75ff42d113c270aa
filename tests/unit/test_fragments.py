"""Streaming DiLoCo's fragments as a pure function of the plan (ps_common.fragments)."""

from __future__ import annotations

import pytest

from ps_common.errors import InvalidRequestError
from ps_common.fragments import assignment, check_fragments, fragment_keys, owned_slots, round_fragment
from ps_common.plan import ParameterSpec, make_plan

# four equal blocks of (weight 64x64, bias 64): strided weight/bias pairs would put every weight in one fragment
SPECS = [
    s
    for i in range(4)
    for s in (ParameterSpec(f"{i}.w", (64, 64), "float32"), ParameterSpec(f"{i}.b", (64,), "float32"))
]
PLAN = make_plan(SPECS, 2, 4096)


def test_each_parameter_joins_the_fragment_with_the_fewest_bytes_so_far() -> None:
    got = assignment(PLAN, 2)
    assert got == {"0.w": 0, "0.b": 1, "1.w": 1, "1.b": 0, "2.w": 0, "2.b": 1, "3.w": 1, "3.b": 0}
    loads = [sum(s.numel for s in SPECS if got[s.key] == f) for f in (0, 1)]
    assert loads[0] == loads[1]  # every round moves half the model
    assert fragment_keys(PLAN, 1, 0) == {s.key for s in SPECS}
    assert fragment_keys(PLAN, 2, 1) == {"0.b", "1.w", "2.b", "3.w"}
    assert [round_fragment(t, 3) for t in range(5)] == [0, 1, 2, 0, 1]


def test_a_shard_s_slots_of_a_round_are_its_partitions_of_the_round_s_fragment() -> None:
    assert owned_slots(PLAN, 0, 1, 7) is None  # F = 1: every partition
    for shard in (0, 1):
        owned = PLAN.owned_by(shard)
        for t in range(4):
            slots = owned_slots(PLAN, shard, 2, t)
            keys = fragment_keys(PLAN, 2, t % 2)
            assert slots == tuple(i for i, p in enumerate(owned) if p.key in keys)
    every = sorted(i for t in (0, 1) for i in owned_slots(PLAN, 0, 2, t))
    assert every == list(range(len(PLAN.owned_by(0))))  # the fragments cover the shard once


def test_more_fragments_than_parameters_are_refused() -> None:
    check_fragments(PLAN, 8)
    with pytest.raises(InvalidRequestError, match="more than the model's 8 parameters"):
        check_fragments(PLAN, 9)
