"""Tensor codecs and partition matching: raw little-endian bytes, exact validation."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from ps_common.codec import (
    DTYPES,
    check_finite,
    decode,
    dtype_from_proto,
    dtype_name,
    dtype_to_proto,
    itemsize,
    torch_dtype,
)
from ps_common.errors import InvalidRequestError, UnknownKeyError
from ps_common.partition import WirePartition
from ps_common.plan import ParameterSpec, make_plan
from ps_proto.v1 import ps_pb2
from ps_server.core.partitions import match_partitions
from tests.helpers.tensors import encode


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_roundtrip_is_bit_exact(name: str) -> None:
    t = torch.randn(1000).to(DTYPES[name].torch)
    data = encode(t)
    assert isinstance(data, bytes) and len(data) == 1000 * t.element_size()
    assert torch.equal(decode(data, name, 1000), t)


def test_bytes_are_little_endian_float32() -> None:
    assert encode(torch.tensor([1.0], dtype=torch.float32)) == b"\x00\x00\x80\x3f"


def test_one_dtype_table_names_torch_and_proto_alike() -> None:
    assert [d.name for d in DTYPES.values()] == list(DTYPES)
    assert {d.proto for d in DTYPES.values()} == set(ps_pb2.Dtype.values()) - {ps_pb2.DTYPE_UNSPECIFIED}
    for name, d in DTYPES.items():
        assert ps_pb2.Dtype.Name(d.proto) == "DTYPE_" + name.upper()
        assert d.itemsize == d.torch.itemsize == itemsize(name)
        assert torch_dtype(name) is d.torch and dtype_name(d.torch) == name
        assert dtype_from_proto(dtype_to_proto(name)) == name


def test_unknown_dtypes_are_refused_in_a_full_sentence() -> None:
    with pytest.raises(InvalidRequestError, match="Unsupported dtype 'int8'; expected one of bfloat16, float16"):
        torch_dtype("int8")
    with pytest.raises(InvalidRequestError, match="Parameters of dtype torch.int64 are not supported"):
        dtype_name(torch.int64)
    with pytest.raises(
        InvalidRequestError, match="Partition dtype 0 is unspecified or unknown; set it to one of DTYPE_FLOAT32"
    ):
        dtype_from_proto(ps_pb2.DTYPE_UNSPECIFIED)


def test_decoding_bytes_warns_nothing_and_leaves_the_warnings_filters_alone() -> None:
    code = (
        "import warnings, numpy, torch, ps_proto.v1.ps_pb2; before = list(warnings.filters); "
        "import ps_common.codec as c; "
        "assert warnings.filters == before, 'codec changed the warnings filters'; "
        "warnings.simplefilter('error'); c.decode(bytes(8), 'float32', 2); "
        "c.decode(memoryview(bytes(4)), 'bfloat16', 2)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_wrong_byte_count_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="need 16"):
        decode(b"\x00" * 15, "float32", 4)


def test_encode_refuses_non_flat_tensors() -> None:
    with pytest.raises(ValueError):
        encode(torch.zeros(2, 2))


PLAN = make_plan([ParameterSpec("w", (10,), "float32"), ParameterSpec("b", (3,), "float32")], 1, 16)


def parts(**override: object) -> list[WirePartition]:
    out = []
    for p in PLAN.owned_by(0):
        fields = {
            "key": p.key,
            "offset": p.offset,
            "length": p.length,
            "dtype": "float32",
            "data": encode(torch.ones(p.length)),
        }
        out.append(WirePartition(**fields))
    if override:
        first = out[0]
        out[0] = WirePartition(**{**first.__dict__, **override})
    return out


def test_match_returns_plan_order() -> None:
    received = parts()[::-1]
    tensors = match_partitions(PLAN, 0, received, "gradient")
    assert [t.numel() for t in tensors] == [p.length for p in PLAN.owned_by(0)]


@pytest.mark.parametrize(
    ("override", "error", "message"),
    [
        ({"key": "nope"}, UnknownKeyError, "Unknown parameter 'nope'"),
        ({"offset": 1}, UnknownKeyError, "not one this shard"),
        ({"length": 3, "data": encode(torch.ones(3))}, UnknownKeyError, "not one this shard"),
        ({"dtype": "float64", "data": encode(torch.ones(4, dtype=torch.float64))}, InvalidRequestError, "dtype"),
        (
            {"dtype": "bfloat16", "data": encode(torch.tensor([1, float("nan"), 0, 0]).bfloat16())},
            InvalidRequestError,
            "NaN",
        ),
        (
            {"dtype": "bfloat16", "data": encode(torch.tensor([1, float("-inf"), 0, 0]).bfloat16())},
            InvalidRequestError,
            "NaN",
        ),
        ({"indices": b"\x00\x00\x00\x00\x00"}, InvalidRequestError, "uint32"),
        (
            {"indices": np.array([2, 1], "<u4").tobytes(), "data": encode(torch.ones(2))},
            InvalidRequestError,
            "ascending",
        ),
        ({"indices": np.array([1, 4], "<u4").tobytes(), "data": encode(torch.ones(2))}, InvalidRequestError, "below"),
        ({"indices": np.array([1], "<u4").tobytes(), "data": encode(torch.ones(2))}, InvalidRequestError, "bytes"),
        (
            {"indices": np.array([1], "<u4").tobytes(), "data": encode(torch.tensor([float("inf")]))},
            InvalidRequestError,
            "NaN",
        ),
        ({"data": b"\x00" * 3}, InvalidRequestError, "bytes"),
        ({"data": encode(torch.tensor([1.0, float("nan"), 0.0, 0.0]))}, InvalidRequestError, "NaN"),
        ({"data": encode(torch.tensor([1.0, float("inf"), 0.0, 0.0]))}, InvalidRequestError, "NaN or infinity"),
    ],
)
def test_bad_partitions_are_refused(override, error, message) -> None:
    with pytest.raises(error, match=message):
        match_partitions(PLAN, 0, parts(**override), "gradient")


def test_narrower_wire_dtypes_are_widened_and_sparse_partitions_densified() -> None:
    values = torch.tensor([1.5, -2.25, 3.0, 0.125])
    (half,) = [
        t for t in match_partitions(PLAN, 0, parts(dtype="bfloat16", data=encode(values.bfloat16())), "gradient")
    ][:1]
    assert half.dtype == torch.float32 and torch.equal(half, values)  # exactly representable in bf16
    sparse = parts(indices=np.array([0, 3], "<u4").tobytes(), data=encode(torch.tensor([5.0, -1.0])))
    dense = match_partitions(PLAN, 0, sparse, "gradient")[0]
    assert torch.equal(dense, torch.tensor([5.0, 0.0, 0.0, -1.0]))
    with pytest.raises(InvalidRequestError, match="Only gradients"):
        match_partitions(PLAN, 0, sparse, "value")


def test_missing_and_duplicated_partitions_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="misses 1"):
        match_partitions(PLAN, 0, parts()[1:], "gradient")
    with pytest.raises(InvalidRequestError, match="twice"):
        match_partitions(PLAN, 0, parts() + parts()[:1], "gradient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_check_finite_refuses_every_non_finite_value_and_accepts_huge_finite_ones(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max
    finite = torch.tensor([big, -big, 1.0, 0.0, torch.finfo(dtype).tiny], dtype=dtype)
    check_finite(finite, "huge values")  # t . t overflows: the exact check decides, and passes
    check_finite(torch.zeros(0, dtype=dtype), "empty")
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 4):
            t = finite.clone()
            t[at] = bad
            with pytest.raises(InvalidRequestError, match="huge values contains NaN or infinity"):
                check_finite(t, "huge values")
    both = torch.tensor([float("inf"), float("-inf")], dtype=dtype)  # inf - inf in a sum: NaN, still refused
    with pytest.raises(InvalidRequestError):
        check_finite(both, "x")
    strided = torch.tensor([1.0, float("nan"), 2.0, 3.0], dtype=dtype)[::2]  # a non-contiguous view: finite
    check_finite(strided, "strided")
