"""The partition plan: deterministic, complete, balanced, bounded by partition_bytes; bounded by the
shard's limits before it is built; a request's partitions checked against it as they arrive."""

from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ps_common.errors import InvalidRequestError, PlanMismatchError, Reason, UnknownKeyError
from ps_common.frames import MESSAGE_OVERHEAD_BYTES, PACKING_VERSION, PARTITION_OVERHEAD_BYTES
from ps_common.modes import ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_common.partition import WirePartition
from ps_common.plan import (
    BALANCE_PIECES,
    DEFAULT_PARTITION_BYTES,
    MIN_PIECE_BYTES,
    ParameterSpec,
    make_plan,
    piece_bytes,
    plan_digest,
    plan_for_digest,
)
from ps_common.text import quote, shown
from ps_server.core.limits import Limits
from ps_server.core.partitions import Admitted, Intake, match_partitions
from ps_server.shard.shard import Shard

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
    assert len(plan.partitions) == 32  # 64 MiB in pieces of 1/16 of a shard's 32 MiB share
    assert plan.shard_bytes() == [32 << 20, 32 << 20]


def test_one_shard_keeps_whole_partitions() -> None:
    plan = make_plan([ParameterSpec("w", (4096, 4096), "float32")], 1)
    assert len(plan.partitions) == 16  # 64 MiB in 4 MiB partitions: nothing to balance


@pytest.mark.parametrize("shards", [2, 3, 4])
@pytest.mark.parametrize(
    "shapes",
    [
        [(9216, 128), (128,), (128, 10), (10,)],  # an MNIST net: one layer outweighs the rest
        [(64, 64), (64,), (64, 10), (10,)],  # smaller than one 4 MiB partition
        [(30000, 1024), (1024,), (1024, 10), (10,), (1000, 50)],  # about 123 MB
    ],
)
def test_bytes_per_shard_are_within_one_piece_and_large_models_within_10_percent(shapes, shards) -> None:
    specs = [ParameterSpec(f"p{i}", s, "float32") for i, s in enumerate(shapes)]
    plan = make_plan(specs, shards)
    loads, piece = plan.shard_bytes(), piece_bytes(specs, shards, DEFAULT_PARTITION_BYTES)
    assert max(loads) <= sum(loads) / shards + piece, loads  # Graham's bound: one piece above the mean
    if sum(loads) >= BALANCE_PIECES * shards * MIN_PIECE_BYTES:  # pieces of 1/16 of a share
        assert max(loads) <= 1.1 * sum(loads) / shards, loads


def test_no_piece_is_cut_below_64_kib() -> None:
    digits = [ParameterSpec("0.weight", (128, 64), "float32"), ParameterSpec("0.bias", (128,), "float32")]
    digits += [ParameterSpec("2.weight", (10, 128), "float32"), ParameterSpec("2.bias", (10,), "float32")]
    assert len(make_plan(digits, 2).partitions) == 4  # each parameter whole (35 pieces of 1.2 KB by cut 2)
    assert len(make_plan(digits, 2, cut=2).partitions) == 35
    big = [ParameterSpec("w", (1 << 18,), "float32")]  # 1 MiB on 2 shards: 64 KiB pieces, not 32 KiB
    assert [p.length for p in make_plan(big, 2).partitions] == [MIN_PIECE_BYTES // 4] * 16
    assert [p.length for p in make_plan(big, 2, 1024).partitions] == [256] * 1024  # partition_bytes still bounds


def test_a_plan_of_the_earlier_cut_is_followed_by_its_digest() -> None:
    specs = [ParameterSpec("w", (9216, 128), "float32"), ParameterSpec("b", (128,), "float32")]
    old = make_plan(specs, 2, cut=1)
    assert old.digest == plan_digest(specs, 2, DEFAULT_PARTITION_BYTES, cut=1)
    assert old.partitions != make_plan(specs, 2).partitions
    assert plan_for_digest(specs, 2, DEFAULT_PARTITION_BYTES, old.digest) == old
    one = make_plan(specs, 1, cut=1)  # one shard: both cuts give the same partitions, today's digest wins
    assert plan_for_digest(specs, 1, DEFAULT_PARTITION_BYTES, one.digest) == make_plan(specs, 1)
    legacy = plan_digest(specs, 2, DEFAULT_PARTITION_BYTES, packing=0, cut=1)
    assert plan_for_digest(specs, 2, DEFAULT_PARTITION_BYTES, legacy).partitions == old.partitions
    small = [ParameterSpec("w", (64, 64), "float32")]  # 16 KiB: cut 2 cut it into 1 KiB pieces
    second = make_plan(small, 2, cut=2)
    assert second.partitions != make_plan(small, 2).partitions
    assert plan_for_digest(small, 2, DEFAULT_PARTITION_BYTES, second.digest) == second
    assert plan_for_digest(specs, 2, DEFAULT_PARTITION_BYTES, make_plan(specs, 2).digest) == make_plan(specs, 2)
    with pytest.raises(InvalidRequestError, match="any plan rule"):
        plan_for_digest(specs, 2, DEFAULT_PARTITION_BYTES, "0" * 64)
    with pytest.raises(InvalidRequestError, match="cut version"):
        make_plan(specs, 2, cut=7)


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


# ------------------------------------------------------------------ bounds before a plan is built
def test_limits_derive_from_message_and_parameter_bytes() -> None:
    limits = Limits()
    assert (limits.max_keys, limits.max_key_bytes, limits.max_partitions) == (65536, 1024, 131072)
    assert limits.max_partition_bytes == 16 * 1024 * 1024 - 64 * 1024
    small = Limits(max_message_bytes=1 << 20, max_parameter_bytes=1 << 40)
    assert (small.max_keys, small.max_key_bytes) == (4096, 256)
    assert small.max_partitions == 4 * ((1 << 40) // (4 << 20))  # scales with the declared capacity
    with pytest.raises(InvalidRequestError, match="--max-parameter-bytes"):
        Limits(max_parameter_bytes=1000)


@pytest.mark.parametrize(
    ("specs", "pbytes", "message"),
    [
        ([ParameterSpec("w", (10**12, 10**12), "float32")], 1, "--max-parameter-bytes"),
        ([ParameterSpec("w", (2**40,), "float32")], 4 << 20, "--max-parameter-bytes"),
        ([ParameterSpec("w", (1 << 20,), "float32")], 4, "more than 131072 partitions"),
        ([ParameterSpec(f"p{i}", (1,), "float32") for i in range(65537)], 4096, "at most 65536"),
        ([ParameterSpec("k" * 1025, (1,), "float32")], 4096, "longer than 1024 bytes"),
        ([ParameterSpec("w", (1,) * 65, "float32")], 4096, "65 dimensions"),
        ([ParameterSpec("w", (4,), "float32")], 32 << 20, "partition_bytes must be in"),
    ],
)
def test_plans_beyond_the_limits_are_refused_before_they_are_built(specs, pbytes, message) -> None:
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError, match=message):
        Limits().check_plan(specs, pbytes)
    assert time.perf_counter() - start < 1.0


def test_a_plan_bomb_stops_at_its_first_key() -> None:
    """The bounds are checked key by key: a million specs after a bomb are never read."""
    read = []

    class Specs(list):
        def __iter__(self):
            for s in super().__iter__():
                read.append(s)
                yield s

    specs = Specs([ParameterSpec("w", (10**12, 10**12), "float32")] * 1000)
    with pytest.raises(InvalidRequestError):
        Limits().check_plan(specs, 1)
    assert len(read) == 1


def test_a_real_model_fits_the_default_limits() -> None:
    Limits().check_plan(SPECS, 4096)
    Limits().check_plan([ParameterSpec("w", (4096, 4096), "float32")] * 2, 4 << 20)


def test_client_text_is_quoted_escaped_and_cut_short() -> None:
    assert quote("fc1.weight") == "'fc1.weight'"
    assert quote("a\nb") == "'a\\nb'"
    long = quote("k" * (1 << 20))
    assert len(long) < 120 and "1048576 bytes" in long
    assert shown("line\nforged\r\x1b[2J") == "line\\nforged\\r\\x1b[2J"
    assert len(shown("x" * 100_000)) == 1024


# ------------------------------------------------------------------ partitions checked as they arrive
def wire(p, data: bytes | None = None, **fields) -> WirePartition:
    values = data if data is not None else torch.ones(p.length).numpy().tobytes()
    return WirePartition(
        **{"key": p.key, "offset": p.offset, "length": p.length, "dtype": "float32", "data": values, **fields}
    )


def test_request_bytes_bound_a_well_formed_request() -> None:
    plan = make_plan(SPECS, 2, 4096)
    for shard in range(2):
        owned = plan.owned_by(shard)
        dense = sum(p.length * 4 + len(p.key) for p in owned)
        assert dense < plan.request_bytes(shard, sparse=False) < plan.request_bytes(shard)
        overhead = MESSAGE_OVERHEAD_BYTES + PARTITION_OVERHEAD_BYTES * len(owned)
        assert plan.request_bytes(shard, sparse=False) == dense + overhead
        assert plan.request_bytes(shard) <= 2 * dense + overhead


def test_the_digest_covers_the_packing_rule_client_and_shard_share() -> None:
    plan = make_plan(SPECS, 2, 4096)
    assert plan.digest == plan_digest(SPECS, 2, 4096, packing=PACKING_VERSION)
    assert plan_digest(SPECS, 2, 4096, packing=PACKING_VERSION + 1) != plan.digest
    assert len({plan.digest, plan_digest(SPECS, 2, 4097), plan_digest(SPECS, 1, 4096)}) == 3


def test_intake_refuses_the_first_bad_partition() -> None:
    plan = make_plan(SPECS, 2, 4096)
    owned = plan.owned_by(0)
    nan = torch.full((owned[1].length,), float("nan")).numpy().tobytes()
    bad = [
        (wire(owned[0]), InvalidRequestError, "sent twice"),
        (wire(owned[1], key="nope"), UnknownKeyError, "Unknown parameter 'nope'"),
        (wire(plan.owned_by(1)[0]), UnknownKeyError, "not one this shard"),
        (wire(owned[1], length=owned[1].length - 1), UnknownKeyError, "not one this shard"),
        (wire(owned[1], data=b"\0" * 3), InvalidRequestError, "bytes"),
        (wire(owned[1], data=nan), InvalidRequestError, "NaN"),
        (wire(owned[1], dtype="float64"), InvalidRequestError, "dtype float64"),
        (wire(owned[1], data=b"\0" * 8, indices=b"\0" * 4), InvalidRequestError, "one value per index"),
    ]
    for part, error, message in bad:
        intake = Intake(plan, 0, "gradient")
        intake.add(wire(owned[0]))
        assert intake.values[0] is not None and intake.bound == math.sqrt(owned[0].length)  # ones: their L2 norm
        with pytest.raises(error, match=message):
            intake.add(part)
    sparse = wire(owned[1], data=b"\0" * 4, indices=b"\0" * 4)
    intake = Intake(plan, 0, "gradient")
    intake.add(sparse)
    dense = intake.values[1]
    assert dense is not None and dense.shape == (owned[1].length,) and intake.bound == math.inf  # made dense
    with pytest.raises(InvalidRequestError, match="dense"):
        Intake(plan, 0, "parameter").add(sparse)
    intake = Intake(plan, 0, "gradient")
    intake.add(wire(owned[0]))
    assert intake.missing() == [f"{p.key}[{p.offset}:]" for p in owned[1:]]
    intake.charge(intake.budget)
    with pytest.raises(InvalidRequestError, match="more than"):
        intake.charge(1)


def test_match_partitions_takes_an_admitted_requests_values_as_its_intake_read_them() -> None:
    plan = make_plan(SPECS, 1, 4096)
    owned = plan.owned_by(0)
    intake = Intake(plan, 0, "gradient")
    admitted = Admitted(intake, [intake.add(wire(p)) for p in owned])
    got = match_partitions(plan, 0, admitted, "gradient")
    assert all(t is v for t, v in zip(got, intake.values, strict=True))  # not read again
    again = match_partitions(plan, 0, list(admitted), "gradient")  # a plain list is read
    assert all(torch.equal(a, b) and a is not b for a, b in zip(again, got, strict=True))
    other = make_plan(SPECS, 1, 4096)  # the same plan, another object (a shard that restarted): read again
    assert all(t is not v for t, v in zip(match_partitions(other, 0, admitted, "gradient"), got, strict=True))
    with pytest.raises(InvalidRequestError, match="sent twice"):
        match_partitions(plan, 0, [*admitted, admitted[0]], "gradient")
    with pytest.raises(InvalidRequestError, match="not in the fragment"):
        match_partitions(plan, 0, admitted, "gradient", expected=[0])
    partial = Intake(plan, 0, "gradient")
    with pytest.raises(InvalidRequestError, match="misses 1 of"):
        match_partitions(plan, 0, Admitted(partial, [partial.add(wire(p)) for p in owned[:-1]]), "gradient")


def test_a_shard_refuses_a_client_that_packs_otherwise_with_plan_mismatch() -> None:
    plan = make_plan(SPECS, 1, 4096)
    values = [
        WirePartition(p.key, p.offset, p.length, "float32", torch.ones(p.length).numpy().tobytes())
        for p in plan.owned_by(0)
    ]
    shard = Shard(0, 1, ModeSettings("sync", num_workers=1))
    shard.init(SPECS, 1, 4096, plan.digest, OptimizerSpec("sgd", {"lr": 0.1}), values)
    other = plan_digest(SPECS, 1, 4096, packing=PACKING_VERSION + 1)
    with pytest.raises(PlanMismatchError) as err:
        shard.check_plan(other)
    assert err.value.reason == Reason.PLAN_MISMATCH
    assert shard.check_plan(plan.digest) is not None
