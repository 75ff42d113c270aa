"""Hand-built frames are protobuf: the same bytes as SerializeToString, read back as FromString does."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import example, given

from ps_common import frames
from ps_common.codec import DTYPES
from ps_common.errors import InvalidRequestError
from ps_proto.v1 import ps_pb2
from tests.helpers.tensors import encode

KEYS = st.text(min_size=1, max_size=12)
DTYPE_NAMES = st.sampled_from(["float32", "float16", "bfloat16", "float64"])
TORCH = {name: d.torch for name, d in DTYPES.items()}


@st.composite
def partitions(draw: st.DrawFn) -> frames.OutPartition:
    n = draw(st.integers(0, 40))
    name = draw(DTYPE_NAMES)
    values = torch.from_numpy(np.array(draw(st.lists(st.floats(-1e3, 1e3), min_size=n, max_size=n)), "float32"))
    values = values.to(TORCH[name]) if n else torch.empty(0, dtype=TORCH[name])
    offset = draw(st.integers(0, 2**40))
    if n and draw(st.booleans()):  # sparse: indices into a longer slice
        length = n + draw(st.integers(0, 100))
        idx = np.sort(np.random.default_rng(n).choice(length, n, replace=False)).astype(np.int32)
        return frames.OutPartition(draw(KEYS), offset, length, values, torch.from_numpy(idx))
    return frames.OutPartition(draw(KEYS), offset, n, values)


def as_proto(p: frames.OutPartition) -> ps_pb2.Partition:
    name = {v: k for k, v in TORCH.items()}[p.values.dtype]
    return ps_pb2.Partition(
        key=p.key,
        offset=p.offset,
        length=p.length,
        dtype=DTYPES[name].proto,
        data=encode(p.values) if p.values.numel() else b"",
        indices=encode(p.indices) if p.indices is not None else b"",
    )


@given(st.integers(0, 2**63), st.lists(partitions(), max_size=4))
def test_a_built_response_is_what_protobuf_serializes(version: int, parts: list[frames.OutPartition]) -> None:
    built = frames.build(parts, frames.uint_field(1, version))
    expected = ps_pb2.PushPullResponse(version=version, partitions=[as_proto(p) for p in parts])
    assert built == expected.SerializeToString()
    if len(parts) <= 1:  # the single-partition messages share the layout
        single = ps_pb2.PullResponse(version=version, partition=as_proto(parts[0]) if parts else None)
        assert built == single.SerializeToString()


@given(st.lists(partitions(), min_size=1, max_size=4), st.integers(0, 2**32 - 1))
def test_reading_agrees_with_protobuf(parts: list[frames.OutPartition], rank: int) -> None:
    header = ps_pb2.PushHeader(rank=rank, clock=7, plan_digest="abc")
    raw = ps_pb2.PushPullRequest(
        header=header, partitions=[as_proto(p) for p in parts], wire_dtype=ps_pb2.DTYPE_BFLOAT16
    ).SerializeToString()
    msg = frames.read(raw)
    assert msg.sub(1, ps_pb2.PushHeader) == header
    assert msg.ints == {3: ps_pb2.DTYPE_BFLOAT16}
    for got, sent in zip(msg.partitions, parts, strict=True):
        assert (got.key, got.offset, got.length) == (sent.key, sent.offset, sent.length)
        assert torch.equal(frames.view(got), sent.values)
        assert bytes(got.indices) == (encode(sent.indices) if sent.indices is not None else b"")


def test_view_is_zero_copy_and_keeps_the_buffer_alive() -> None:
    raw = frames.build([frames.OutPartition("w", 0, 3, torch.tensor([1.0, 2.0, 3.0]))])
    t = frames.view(frames.read(raw).partitions[0])
    del raw
    assert t.tolist() == [1.0, 2.0, 3.0]


def test_field_order_and_unknown_fields_follow_protobuf() -> None:
    # grpcurl and other encoders may order fields differently or add fields of a later release
    p = ps_pb2.Partition(key="w", offset=4, length=1, dtype=ps_pb2.DTYPE_FLOAT32, data=encode(torch.tensor([5.0])))
    reordered = (
        frames.bytes_field(5, p.data) + frames.uint_field(4, 1) + frames.uint_field(3, 1) + frames.bytes_field(1, b"w")
    )
    unknown = frames.uint_field(99, 12) + frames.tag(98, frames.I32) + b"\x00" * 4
    raw = frames.uint_field(1, 3) + frames.bytes_field(2, unknown + reordered)
    part = frames.read(raw).partitions[0]
    assert (part.key, part.offset, part.length, frames.view(part).tolist()) == ("w", 0, 1, [5.0])


@pytest.mark.parametrize(
    "raw",
    [
        b"\x08",  # varint cut short
        b"\x12\x05ab",  # field longer than the message
        b"\x0b",  # group start (wire type 3)
        b"\x00\x01",  # field number 0
        b"\x12\x02\x20\x07",  # partition with an unknown dtype enum value
        b"\x12\x04\x0a\x02\xff\xfe",  # key that is not UTF-8
    ],
)
def test_malformed_frames_are_invalid_argument(raw: bytes) -> None:
    with pytest.raises(InvalidRequestError):
        frames.read(raw)


def _fields_byte_by_byte(buf: memoryview) -> list[tuple[int, int, int | bytes]]:
    """The protobuf encoding rules read plainly, every varint through ``_read_varint``: what
    :func:`frames.iter_fields` (one-byte varints read inline) must agree with."""
    out: list[tuple[int, int, int | bytes]] = []
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = frames._read_varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        if field == 0 or wire_type not in (0, 1, 2, 5):
            raise InvalidRequestError("malformed")
        value: int | bytes
        if wire_type == 0:
            value, pos = frames._read_varint(buf, pos, end)
        else:
            if wire_type == 2:
                n, pos = frames._read_varint(buf, pos, end)
            else:
                n = 8 if wire_type == 1 else 4
            if pos + n > end:
                raise InvalidRequestError("malformed")
            raw = bytes(buf[pos : pos + n])
            value, pos = (raw if wire_type == 2 else int.from_bytes(raw, "little")), pos + n
        out.append((field, wire_type, value))
    return out


EDGE_BYTES = st.sampled_from([0x00, 0x01, 0x02, 0x08, 0x09, 0x0A, 0x0D, 0x10, 0x12, 0x7F, 0x80, 0x81, 0xFF])
"""Tags of each wire type, the one-byte varint limit (0x7F, 0x80) and continuation bytes."""


@given(st.lists(st.one_of(EDGE_BYTES, st.integers(0, 0xFF)), max_size=24).map(bytes))
@example(b"\x08\x7f\x08\x80\x01")  # varints of one byte and of two
@example(b"\x08\x80")  # a varint cut after its continuation byte
@example(b"\x80\x01\x05")  # field 16: a two-byte tag
@example(b"\x12\x80\x01" + bytes(128))  # a length of two bytes
def test_fields_are_read_as_the_encoding_rules_read_them(raw: bytes) -> None:
    """Any bytes: the same fields, or the same refusal, as a plain varint-by-varint reader."""
    try:
        expected: list[tuple[int, int, int | bytes]] | None = _fields_byte_by_byte(memoryview(raw))
    except InvalidRequestError:
        expected = None
    try:
        got = [(f, w, bytes(v) if isinstance(v, memoryview) else v) for f, w, v in frames.iter_fields(memoryview(raw))]
    except InvalidRequestError:
        got = None
    assert got == expected


def test_pack_fills_messages_in_order_up_to_the_budget() -> None:
    sizes = [(100, 1), (100, 1), (2000, 1), (10, 1), (10, 1)]
    groups = frames.pack(sizes, 400)
    assert groups == [[0, 1], [2], [3, 4]]
    assert frames.pack([], 400) == []
    assert sum(len(g) for g in frames.pack([(5, 3)] * 1000, 4096)) == 1000


def test_packing_counts_wire_bytes_key_bytes_and_top_k_indices() -> None:
    budget = 2 * (1000 + frames.PARTITION_OVERHEAD_BYTES + 1)
    assert frames.packing([("a", 250), ("b", 250)], [4, 4], budget) == [[0, 1]]
    assert frames.packing([("a", 250), ("b", 251)], [4, 4], budget) == [[0], [1]]
    assert frames.packing([("é", 250), ("b", 250)], [4, 4], budget) == [[0], [1]]  # 2 key bytes
    # top-k: k values of 4 bytes, each with a 4-byte index
    assert frames.packing([("a", 1000), ("b", 1000)], [4, 4], budget, k=lambda n: n // 8) == [[0, 1]]


def test_response_frames_cast_and_pack() -> None:
    tensors = [torch.arange(4, dtype=torch.float32), torch.ones(2)]
    groups = frames.packing([("a", 4), ("b", 2)], [2, 2], 1 << 20)
    assert groups == [[0, 1]]
    out = frames.response_frames(9, [("a", 0, 4), ("b", 0, 2)], tensors, torch.bfloat16, groups)
    assert len(out) == 1
    msg = ps_pb2.PushPullResponse.FromString(out[0])
    assert msg.version == 9 and [p.dtype for p in msg.partitions] == [ps_pb2.DTYPE_BFLOAT16] * 2
    assert len(frames.response_frames(9, [("a", 0, 4), ("b", 0, 2)], tensors)) == 2
    assert frames.response_frames(3, [], []) == [ps_pb2.PullResponse(version=3).SerializeToString()]


def test_read_checks_each_partition_as_it_is_read_and_stops_at_the_first_refusal() -> None:
    header = frames.bytes_field(1, ps_pb2.PushHeader(rank=3).SerializeToString())
    tiny = frames.build([frames.OutPartition("w", 0, 1, torch.ones(1))])
    prefix = header + frames.uint_field(3, 2)
    raw = prefix + tiny * 100_000
    seen: list[tuple[dict, dict]] = []

    def check(msg: frames.Message, part):
        seen.append((dict(msg.ints), dict(msg.blobs)))  # the fields before the first partition are there
        if len(seen) == 3:
            raise InvalidRequestError("third")
        return part

    with pytest.raises(InvalidRequestError, match="third"):
        frames.read(raw, check)
    assert len(seen) == 3
    assert seen[0] == ({3: 2}, {1: ps_pb2.PushHeader(rank=3).SerializeToString()})
    assert len(frames.read(raw[: len(prefix) + 10 * len(tiny)], lambda m, p: p).partitions) == 10


def test_a_message_of_many_tiny_unknown_fields_is_refused_early() -> None:
    junk = frames.uint_field(9, 1) * 1_000_000
    with pytest.raises(InvalidRequestError, match=f"more than {frames.MAX_FIELDS} fields"):
        frames.read(junk)
    part = ps_pb2.Partition(key="w", length=1, dtype=ps_pb2.DTYPE_FLOAT32).SerializeToString()
    with pytest.raises(InvalidRequestError, match="a partition with more"):
        frames.read(frames.bytes_field(2, part + frames.uint_field(9, 1) * 100))
    # a message with a few unknown fields of a later release still reads
    assert frames.read(frames.uint_field(9, 1) * frames.MAX_FIELDS + frames.bytes_field(2, part)).partitions


@given(st.integers(0, 2**63), st.lists(partitions(), max_size=4))
def test_build_chunks_are_the_built_message_unjoined(version: int, parts: list[frames.OutPartition]) -> None:
    chunks = frames.build_chunks(parts, frames.uint_field(1, version))
    assert b"".join(chunks) == frames.build(parts, frames.uint_field(1, version))


def test_build_chunks_send_the_tensors_own_memory() -> None:
    values = torch.tensor([1.0, 2.0, 3.0])
    chunks = frames.build_chunks([frames.OutPartition("w", 0, 3, values)])
    values[1] = 7.0  # the chunk is a view: what goes out is the tensor as it is when sent
    assert frames.view(frames.read(b"".join(chunks)).partitions[0]).tolist() == [1.0, 7.0, 3.0]
