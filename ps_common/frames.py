"""Hand-built ps.v1 messages that carry partitions: one copy of each payload, zero-copy reads.

The data RPCs (Push, Pull, PushPull, Exchange) are registered with pass-through (de)serializers on
both sides, so gRPC hands over and takes ``bytes``, which this module writes and reads with the
protobuf encoding rules (https://protobuf.dev/programming-guides/encoding/): the bytes
``SerializeToString`` would produce and ``FromString`` accepts (``tests/unit/test_frames.py`` checks
both ways), so grpcurl and any protobuf client interoperate. Per partition, sending copies the
payload once, from the tensor into the message (``bytes.join`` over a memoryview of the tensor), not
tensor → ``bytes`` → protobuf field → message; receiving views it in place (``torch.frombuffer``
over the received message), not parse → ``bytes`` field → tensor. Every message with partitions has
them in field 2 (``PushRequest.partition``, ``PullResponse.partition``, ``PushPullRequest.partitions``
…) and its ``version`` (if any) in field 1, so one builder serves them all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ps_common import fields
from ps_common.codec import DTYPES, decode, dtype_from_proto
from ps_common.errors import InvalidRequestError
from ps_common.partition import WirePartition

VARINT, I64, LEN, I32 = 0, 1, 2, 5
"""Protobuf wire types."""

PARTITION_FIELD = fields.PARTITIONS
"""Field number of the partition(s) in every message that carries them."""

PARTITION_OVERHEAD_BYTES = 64
"""Bytes a partition's fields other than its key and payload take at most on the wire (the tag and
length of the partition and of each of its fields): :func:`pack` counts them per partition, and so
does ``Plan.request_bytes``."""

MESSAGE_OVERHEAD_BYTES = 64 * 1024
"""Bytes a message may take besides its partitions (version, header, answer): a shard's largest
``partition_bytes`` is ``--max-message-bytes`` less this, a client's channel takes messages of
``partition_bytes`` plus this, and a request stream's header may spend this much."""

PACKING_VERSION = 1
"""Version of :func:`pack` (with :data:`PARTITION_OVERHEAD_BYTES`), the rule by which the shard and
the worker both group partitions into PushPull messages. The plan digest covers it, so a worker that
packs otherwise is refused (PLAN_MISMATCH) instead of misreading frames: bump it with any change."""

MAX_FIELDS = 64
"""Most fields of a partition, and of a message besides its partitions: a few more than ps.v1 has,
so a message of a million tiny unknown fields is refused at the 65th, not parsed whole."""


_SMALL = [bytes((i,)) for i in range(0x80)]


def varint(n: int) -> bytes:
    """Base-128 varint of a non-negative integer."""
    if n < 0x80:
        return _SMALL[n]
    if n < 0x4000:  # two bytes (below 16 KiB), three (below 2 MiB): one call
        return bytes((n & 0x7F | 0x80, n >> 7))
    if n < 0x200000:
        return bytes((n & 0x7F | 0x80, n >> 7 & 0x7F | 0x80, n >> 14))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def tag(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


def uint_field(field: int, value: int) -> bytes:
    """A varint field, or nothing for 0 (proto3 leaves defaults out)."""
    return tag(field, VARINT) + varint(value) if value else b""


def bytes_field(field: int, value: bytes) -> bytes:
    """A length-delimited field, or nothing when empty."""
    return tag(field, LEN) + varint(len(value)) + value if value else b""


def _buffer(t: torch.Tensor) -> memoryview:
    """The bytes of a 1-D contiguous CPU tensor, without a copy."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


@dataclass(frozen=True)
class OutPartition:
    """A partition to send: ``values`` (1-D CPU tensor, the wire dtype) for the slice
    [offset, offset + length) of ``key``; with ``indices`` (1-D int32/uint32 tensor, ascending), a
    top-k sparse slice whose ``values`` are the values at those indices."""

    key: str
    offset: int
    length: int
    values: torch.Tensor
    indices: torch.Tensor | None = None


_TAG_KEY, _TAG_OFFSET, _TAG_LENGTH, _TAG_DTYPE, _TAG_DATA, _TAG_INDICES = (
    bytes([fields.PARTITION_KEY << 3 | LEN]),
    bytes([fields.PARTITION_OFFSET << 3 | VARINT]),
    bytes([fields.PARTITION_LENGTH << 3 | VARINT]),
    bytes([fields.PARTITION_DTYPE << 3 | VARINT]),
    bytes([fields.PARTITION_DATA << 3 | LEN]),
    bytes([fields.PARTITION_INDICES << 3 | LEN]),
)
_DTYPE_FIELD = {d.torch: _TAG_DTYPE + varint(d.proto) for d in DTYPES.values()}
"""The dtype field of each wire dtype, encoded."""


_TAG_PARTITION = bytes([PARTITION_FIELD << 3 | LEN])


@functools.lru_cache(maxsize=4096)  # a plan's partitions, each encoded once per job (more: the least used go)
def _head(key: str, offset: int, length: int, dtype: torch.dtype) -> bytes:
    """A partition's fields before its values (key, offset, length, dtype), encoded."""
    raw = key.encode()
    key_field = _TAG_KEY + varint(len(raw)) + raw if raw else b""
    offset_field = _TAG_OFFSET + varint(offset) if offset else b""
    return key_field + offset_field + (_TAG_LENGTH + varint(length) if length else b"") + _DTYPE_FIELD[dtype]


def _partition_chunks(p: OutPartition) -> list[bytes | memoryview]:
    """One partition (field 2 of the message) as buffers: its fields, and its tensors' own memory."""
    head = _head(p.key, p.offset, p.length, p.values.dtype)
    data = _buffer(p.values)
    chunks: list[bytes | memoryview] = [b"", head]
    size = len(head)
    if data:
        lead = _TAG_DATA + varint(len(data))
        chunks += (lead, data)
        size += len(lead) + len(data)
    if p.indices is not None and p.indices.numel():
        idx = _buffer(p.indices)
        lead = _TAG_INDICES + varint(len(idx))
        chunks += (lead, idx)
        size += len(lead) + len(idx)
    chunks[0] = _TAG_PARTITION + varint(size)
    return chunks


def build_chunks(parts: Iterable[OutPartition], prefix: bytes = b"") -> list[bytes | memoryview]:
    """The message :func:`build` makes, as the buffers it joins: the encoded fields, and the
    bytes of each partition's tensors themselves (views, no copy), for a scatter-gather send
    (:func:`ps_common.dataconn.send_all`). The tensors must not change until it is sent."""
    chunks: list[bytes | memoryview] = [prefix]
    for p in parts:
        chunks += _partition_chunks(p)
    return chunks


def build(parts: Iterable[OutPartition], prefix: bytes = b"") -> bytes:
    """One message: ``prefix`` (already encoded fields), then the partitions in field 2; the only
    copy of each payload is the final ``bytes.join``."""
    return b"".join(build_chunks(parts, prefix))


def pack(sizes: Sequence[tuple[int, int]], budget: int) -> list[list[int]]:
    """Group consecutive partitions into messages of at most ``budget`` bytes.

    Args:
        sizes: (payload bytes, key bytes) of each partition, in order.
        budget: bytes per message (``partition_bytes``); a partition larger than it goes alone.

    Returns:
        Lists of indices into ``sizes``, in order; each partition appears once.
    """
    groups: list[list[int]] = []
    used = budget + 1
    for i, (nbytes, keylen) in enumerate(sizes):
        cost = nbytes + keylen + PARTITION_OVERHEAD_BYTES
        if used + cost > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += cost
    return groups


def packing(
    parts: Sequence[tuple[str, int]],
    itemsizes: Sequence[int],
    budget: int,
    k: Callable[[int], int] | None = None,
) -> list[list[int]]:
    """How a shard's partitions pack into PushPull messages: the one rule the shard (its
    response) and the worker (its request; its expectation of a one-message response, which
    decides PushPullOnce) both apply.

    Args:
        parts: (key, length in elements) of each partition, in plan order.
        itemsizes: bytes per element on the wire, one per partition.
        budget: ``partition_bytes``.
        k: top-k: elements sent of a partition of n elements (each value with a 4-byte index);
            None: dense.

    Returns:
        As :func:`pack`.
    """
    sizes = [
        ((k(n) * (size + 4)) if k is not None else n * size, len(key.encode()))
        for (key, n), size in zip(parts, itemsizes, strict=True)
    ]
    return pack(sizes, budget)


# ---------------------------------------------------------------------------------- reading
def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise InvalidRequestError("Malformed message: a varint runs past the end; send a valid ps.v1 message.")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def iter_fields(buf: memoryview, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int, int | memoryview]]:
    """The fields of one encoded message as they are read: (field number, wire type, value); a
    varint's value is an int, a length-delimited field's a memoryview into ``buf`` (no copy). A
    caller that stops early reads no further.

    Raises:
        InvalidRequestError: malformed encoding (truncated, groups, field number 0).
    """
    end = len(buf) if end is None else end
    pos = start
    while pos < end:
        key = buf[pos]  # one-byte varints (field numbers below 16, small values) read inline
        if key < 0x80:
            pos += 1
        else:
            key, pos = _read_varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise InvalidRequestError("Malformed message: field number 0; send a valid ps.v1 message.")
        value: int | memoryview
        if wire_type == VARINT:
            if pos < end and buf[pos] < 0x80:
                value, pos = buf[pos], pos + 1
            else:
                value, pos = _read_varint(buf, pos, end)
        elif wire_type == LEN:
            if pos < end and buf[pos] < 0x80:
                n, pos = buf[pos], pos + 1
            else:
                n, pos = _read_varint(buf, pos, end)
            if pos + n > end:
                raise InvalidRequestError("Malformed message: a field runs past the end; send a valid ps.v1 message.")
            value, pos = buf[pos : pos + n], pos + n
        elif wire_type in (I64, I32):
            n = 8 if wire_type == I64 else 4
            if pos + n > end:
                raise InvalidRequestError("Malformed message: a field runs past the end; send a valid ps.v1 message.")
            value, pos = int.from_bytes(buf[pos : pos + n], "little"), pos + n
        else:
            raise InvalidRequestError(f"Malformed message: wire type {wire_type}; send a valid ps.v1 message.")
        yield field, wire_type, value


def read_partition(buf: memoryview) -> WirePartition:
    """A Partition message's fields; ``data``/``indices`` view ``buf`` (no copy).

    Raises:
        InvalidRequestError: malformed, or a dtype that is unset or unknown.
    """
    key, offset, length, dtype = "", 0, 0, 0
    data: memoryview | bytes = b""
    indices: memoryview | bytes = b""
    for n, (field, wire_type, value) in enumerate(iter_fields(buf)):
        if n == MAX_FIELDS:
            _too_many("a partition with")
        if isinstance(value, memoryview):
            if field == fields.PARTITION_KEY:
                try:
                    key = str(value, "utf-8")
                except UnicodeDecodeError:
                    raise InvalidRequestError("Partition key is not UTF-8.") from None
            elif field == fields.PARTITION_DATA:
                data = value
            elif field == fields.PARTITION_INDICES:
                indices = value
        elif wire_type == VARINT:
            if field == fields.PARTITION_OFFSET:
                offset = value
            elif field == fields.PARTITION_LENGTH:
                length = value
            elif field == fields.PARTITION_DTYPE:
                dtype = value
    return WirePartition(key, offset, length, dtype_from_proto(dtype), data, indices)  # type: ignore[arg-type]


@dataclass
class Message:
    """A read message: its partitions (field 2), its varint fields and the raw bytes of its other
    length-delimited fields (occurrences of one field concatenated: protobuf's merge rule)."""

    partitions: list[WirePartition]
    ints: dict[int, int]
    blobs: dict[int, bytes]

    def sub(self, field: int, cls: Any) -> Any:
        """The embedded message of ``field`` parsed as ``cls``, or None when absent.

        Raises:
            InvalidRequestError: it does not parse.
        """
        raw = self.blobs.get(field)
        if raw is None:
            return None
        try:
            return cls.FromString(raw)
        except Exception:
            raise InvalidRequestError(f"Malformed {cls.__name__}; send a valid ps.v1 message.") from None


def read(data: bytes | memoryview, check: Callable[[Message, WirePartition], WirePartition] | None = None) -> Message:
    """Read a message that carries partitions in field 2.

    Args:
        data: the encoded message.
        check: called on each partition as soon as it is read, before the next one, with the
            message read so far (for the message's first partition, every field before it is in
            ``ints`` and ``blobs``); returns the partition to keep. A check that raises stops the
            reading: a message packed with partitions is refused at the first bad one.

    Raises:
        InvalidRequestError: malformed encoding or partitions; what ``check`` raises.
    """
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    msg = Message([], {}, {})
    pending: dict[int, list[memoryview]] = {}
    others = 0
    for field, _, value in iter_fields(buf):
        if field != PARTITION_FIELD:
            others += 1
            if others > MAX_FIELDS:
                _too_many("a message with, besides its partitions,")
        if isinstance(value, memoryview):
            if field == PARTITION_FIELD:
                part = read_partition(value)
                if check is not None:
                    if not msg.partitions:
                        _merge(msg.blobs, pending)
                    part = check(msg, part)
                msg.partitions.append(part)
            else:
                pending.setdefault(field, []).append(value)
        else:
            msg.ints[field] = value
    _merge(msg.blobs, pending)
    return msg


def _too_many(what: str) -> None:
    raise InvalidRequestError(f"Malformed message: {what} more than {MAX_FIELDS} fields; send a valid ps.v1 message.")


def _merge(blobs: dict[int, bytes], pending: dict[int, list[memoryview]]) -> None:
    """Append ``pending`` occurrences of length-delimited fields to ``blobs`` (protobuf's merge rule
    for a repeated embedded message), and clear it."""
    for field, views in pending.items():
        blobs[field] = blobs.get(field, b"") + b"".join(views)
    pending.clear()


def view(p: WirePartition) -> torch.Tensor:
    """A read-only 1-D tensor over a received partition's values (no copy).

    Returns:
        Shape ``[n]``, dtype of ``p.dtype``; n = ``p.length`` for a dense partition, the number of
        indices for a sparse one.

    Raises:
        InvalidRequestError: the byte count does not match.
    """
    count = len(p.indices) // 4 if len(p.indices) else p.length
    return decode(p.data, p.dtype, count)


def response_frames(
    version: int,
    partitions: Sequence[tuple[str, int, int]],
    tensors: Sequence[torch.Tensor],
    wire_dtype: torch.dtype | None = None,
    groups: Sequence[Sequence[int]] | None = None,
) -> list[bytes]:
    """Messages of ``version`` carrying ``tensors`` (PullResponse, ExchangeResponse and
    PushPullResponse share this layout: version in field 1, partitions in field 2).

    Args:
        version: the shard version the values belong to.
        partitions: (key, offset, length) of each tensor.
        tensors: 1-D CPU tensors, one per partition; copied once here.
        wire_dtype: cast to this dtype on the wire (None: as they are).
        groups: which partitions share a message (:func:`packing`); None: one per message.

    Returns:
        The encoded messages; a shard that owns nothing still sends one, with its version.
    """
    prefix = uint_field(fields.VERSION, version)
    if not tensors:
        return [prefix]
    outs = [
        OutPartition(key, offset, length, t if wire_dtype is None or t.dtype == wire_dtype else t.to(wire_dtype))
        for (key, offset, length), t in zip(partitions, tensors, strict=True)
    ]
    if groups is None:
        groups = [[i] for i in range(len(outs))]
    return [build((outs[i] for i in g), prefix) for g in groups]
