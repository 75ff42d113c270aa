"""The data connection: a PushPull's partitions as raw bytes on a TCP connection beside gRPC.

grpcio's Python API copies every message twice on each side (a serializer must return ``bytes``,
which grpcio copies into its own slice; a received message becomes a fresh ``bytes``). On the data
connection the worker sends a gradient straight from the tensor's memory (``socket.sendmsg`` of
memoryviews) and receives new values straight into the weights (``socket.recv_into``); the shard
receives each partition into a tensor of its own. The PushPull call itself (header, push's
answer, errors, deadlines, authorization) stays on gRPC; only the partitions move here
(docs/architecture.md#7-gradient-path). A push of one message (a small model) goes here as a whole
call instead, where grpcio's per-call cost would be most of the step.

Wire format (little-endian, every integer fixed width):

- hello, worker → shard, once: :data:`HELLO` (magic ``GPSD``, protocol, rank, incarnation,
  session, token length) then the token's bytes (the worker token the gRPC calls carry, or none);
  the shard answers :data:`REPLY` (magic, status 0 = accepted), or closes the connection. The
  session is the rank's ``JoinResponse.session`` on that shard: a push frame is taken only while it
  is the rank's current session there (checked at each frame's first record), a hello naming a
  rank that has a connection replaces it only with that session, and a call must be stamped with
  the hello's rank.
- a frame, either way: one :data:`RECORD` (sequence, slot, dtype, byte count) followed by that
  many bytes for each partition, then an end record (slot :data:`END`, byte count = the number
  of partition records). ``slot`` is the partition's position among the shard's partitions in
  plan order; ``dtype`` its ``ps.v1.Dtype`` value. A push frame's sequence is the one its
  PushPull header names (``PushHeader.data_sequence``); the answer's frame has the same.
- a call, worker → shard: one :data:`RECORD` with slot :data:`CALL`, the call's timeout in
  milliseconds in the dtype field (0: none) and the byte count of the request that follows: a whole
  ``PushPullOnce`` request message, the same bytes the unary gRPC call carries. The shard answers
  one record with slot :data:`CALL`, the gRPC status code's value in the dtype field and the byte
  count of what follows: the PushPullOnce response message (code 0, OK), or :data:`STATUS` and the
  refusal's ``ps-reason`` and details (UTF-8). A small model's step takes one round trip on the
  connection and no gRPC call at all; the checks, semantics, errors and metrics are the RPC's
  (the shard runs the same servicer method; docs/architecture.md#7-gradient-path).
- the answer of a PushPull whose push came as a frame, shard → worker, before the call's answer on
  gRPC: the values frame of the version the push landed in; or :data:`ABORT` with 0 in the dtype
  field (no values: the call's status says why); or, for a streamed sync round
  (:mod:`ps_server.shard.round_stream`), :data:`SPECULATE`, then the slots' records as each slot is stepped
  (any order), then the end record once the round closed as streamed; or, instead of that end
  record, :data:`ABORT` with 1 (drop the speculative values: the round's values follow as a frame)
  or with 0. A marker record's byte count is 0. The worker writes speculative values into its
  weights as they come; they are the version once the end record and the call's OK came, and an
  ``ABORT`` 1's frame (or, after an ``ABORT`` 0, the retried call's answer) overwrites them.
"""

from __future__ import annotations

import math
import select
import socket
import struct
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the flags import DATA_PATHS from here before torch may be imported
    import torch

DATA_PATHS = ("tcp", "grpc")
"""Where a worker's PushPull partitions (and a small model's PushPullOnce) travel: ``tcp``, the
shard's data connection when it offers one, else gRPC; ``grpc``, always gRPC."""

MAGIC = b"GPSD"
PROTOCOL = 3
"""3: the hello carries the rank's session; 2: answers may be streamed (:data:`SPECULATE`,
:data:`ABORT`); 1 had neither."""

HELLO = struct.Struct("<4sIIQQI")
"""magic, protocol, rank, incarnation, session, token length (then the token)."""

REPLY = struct.Struct("<4sI")
"""magic, status (0: accepted)."""

RECORD = struct.Struct("<QIIQ")
"""sequence, slot, dtype (``ps.v1.Dtype``), byte count."""

END = 0xFFFFFFFF
"""The slot of a frame's end record."""

CALL = 0xFFFFFFFE
"""The slot of a call record (a whole PushPullOnce request, or its answer)."""

SPECULATE = 0xFFFFFFFD
"""The slot of the marker that begins a streamed round's speculative answer."""

ABORT = 0xFFFFFFFC
"""The slot of the marker that drops an answer's speculative values (dtype field 1: the round's
values follow as a frame; 0: no values, the call's status says why)."""

STATUS = struct.Struct("<I")
"""A refused call's answer: the byte length of its ``ps-reason``, then the reason, then the details."""

MAX_CALL_MS = 0xFFFFFFFF
"""Longest timeout a call record carries (about 49.7 days)."""

MAX_TOKEN_BYTES = 4096
"""Longest token a hello may carry."""

IOV_MAX = 512
"""Buffers per ``sendmsg`` call (Linux allows 1024)."""

CHUNK_BYTES = 4 * 1024 * 1024
"""Bytes asked of one ``recv_into``: a larger request changes nothing on loopback."""


class DataConnectionError(ConnectionError):
    """The data connection broke, timed out, or carried something other than what the plan says."""


def send_all(sock: socket.socket, buffers: Sequence[bytes | memoryview], deadline: float) -> int:
    """Send every byte of ``buffers`` in order, without copying them (``sendmsg`` of up to
    :data:`IOV_MAX` buffers at a time, never blocking past ``deadline``, a ``time.monotonic()``:
    a peer that stops reading cannot hold the sender); returns the byte count.

    Raises:
        DataConnectionError: the deadline passed with bytes still to send.
        OSError: the connection broke.
    """
    views = _bytes_of(buffers)
    total = left = sum(map(len, views))
    poll = select.poll()
    poll.register(sock, select.POLLOUT)
    i = 0
    while left:
        wait = deadline - time.monotonic()
        if wait <= 0:
            raise DataConnectionError(f"timed out with {left} bytes left to send")
        if not poll.poll(min(wait, 60.0) * 1000):
            continue
        try:
            sent = sock.sendmsg(views[i : i + IOV_MAX], [], socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue
        left -= sent
        if left:  # sent in part: skip the buffers sent whole, keep the rest of the one cut
            while sent >= len(views[i]):
                sent -= len(views[i])
                i += 1
            if sent:
                views[i] = memoryview(views[i])[sent:]  # not a copy of bytes
    return total


def _bytes_of(buffers: Iterable[bytes | memoryview]) -> list[bytes | memoryview]:
    """The non-empty ``buffers``, each one whose ``len()`` is its byte count (a memoryview of wider
    items or of several dimensions is cast to bytes; the producers here already give bytes)."""
    return [
        b if b.__class__ is not memoryview or (b.ndim == 1 and b.itemsize == 1) else b.cast("B") for b in buffers if b
    ]


def recv_exact(sock: socket.socket, into: memoryview, deadline: float | None = None) -> None:
    """Fill ``into`` (a writable byte memoryview) from ``sock``.

    Args:
        deadline: ``time.monotonic()`` by which the bytes must be in (None: the socket's timeout
            alone bounds each wait).

    Raises:
        DataConnectionError: the peer closed the connection first, or the deadline passed.
        OSError: the connection broke.
    """
    pos, n = 0, len(into)
    while pos < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DataConnectionError(f"timed out with {pos} of {n} bytes received")
            sock.settimeout(min(left, 60.0))
        got = sock.recv_into(into[pos : min(n, pos + CHUNK_BYTES)])
        if not got:
            raise DataConnectionError(f"the peer closed the connection after {pos} of {n} bytes")
        pos += got


def recv_struct(sock: socket.socket, fmt: struct.Struct, deadline: float | None = None) -> tuple[int, ...]:
    """Read one fixed-width header.

    Raises:
        DataConnectionError, OSError: as :func:`recv_exact`.
    """
    buf = bytearray(fmt.size)
    recv_exact(sock, memoryview(buf), deadline)
    return fmt.unpack(buf)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a 1-D contiguous CPU tensor, writable, without a copy."""
    import torch

    return memoryview(t.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def record(sequence: int, slot: int, values: torch.Tensor) -> list[bytes | memoryview]:
    """Partition ``slot`` of frame ``sequence``: its record and the bytes of ``values`` (a 1-D
    contiguous CPU tensor, sent from its memory; the record's dtype is the tensor's)."""
    from ps_common.codec import dtype_name, dtype_to_proto

    data = byte_view(values)
    return [RECORD.pack(sequence, slot, dtype_to_proto(dtype_name(values.dtype)), len(data)), data]


def marker(sequence: int, slot: int, value: int = 0) -> bytes:
    """A :data:`SPECULATE` or :data:`ABORT` marker of answer frame ``sequence``."""
    return RECORD.pack(sequence, slot, value, 0)


def end(sequence: int, count: int) -> bytes:
    """The end record of frame ``sequence`` after ``count`` partitions."""
    return RECORD.pack(sequence, END, 0, count)


def frame(sequence: int, slots: Sequence[torch.Tensor]) -> list[bytes | memoryview]:
    """A whole frame: ``slots`` (1-D contiguous CPU tensors, plan order) and its end record."""
    out: list[bytes | memoryview] = []
    for i, values in enumerate(slots):
        out += record(sequence, i, values)
    out.append(end(sequence, len(slots)))
    return out


Body = bytes | memoryview | Sequence[bytes | memoryview]
"""A call's request or answer body: one buffer, or the buffers of one message in order (sent
without joining them: :func:`ps_common.frames.build_chunks`)."""


def _chunks(body: Body) -> list[bytes | memoryview]:
    return _bytes_of([body] if isinstance(body, bytes | bytearray | memoryview) else body)


def call(sequence: int, request: Body, timeout: float | None) -> list[bytes | memoryview]:
    """Call ``sequence``: its record (``timeout`` seconds, None for none) and ``request``."""
    ms = 0 if timeout is None else min(MAX_CALL_MS, max(1, math.ceil(timeout * 1000)))
    chunks = _chunks(request)
    return [RECORD.pack(sequence, CALL, ms, sum(map(len, chunks))), *chunks]


def answer(sequence: int, code: int, body: Body) -> list[bytes | memoryview]:
    """The answer of call ``sequence``: status ``code`` (a ``grpc.StatusCode`` value; 0 for OK) and
    ``body`` (the response message, or :func:`refusal`)."""
    chunks = _chunks(body)
    return [RECORD.pack(sequence, CALL, code, sum(map(len, chunks))), *chunks]


UNZEROED_BYTES = 128 * 1024
"""From this size :func:`buffer` skips zeroing; below it a ``bytearray`` costs less than an empty
tensor's fixed overhead (about 3.5 µs here, what zeroing 128 KiB takes; 4 MB take 146 µs)."""


def buffer(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` to receive into; from :data:`UNZEROED_BYTES` on, not zeroed
    first (``bytearray(n)`` writes every byte once before the receive does again)."""
    if nbytes < UNZEROED_BYTES:
        return memoryview(bytearray(nbytes))
    import torch

    return byte_view(torch.empty(nbytes, dtype=torch.uint8))


def refusal(reason: str, details: str) -> bytes:
    """The body of a refused call's answer."""
    raw = reason.encode()
    return STATUS.pack(len(raw)) + raw + details.encode()


def parse_refusal(body: bytes) -> tuple[str, str]:
    """(reason, details) of a refused call's answer body.

    Raises:
        DataConnectionError: the body is too short for the reason it announces.
    """
    if len(body) < STATUS.size:
        raise DataConnectionError("a refusal without its status")
    (n,) = STATUS.unpack_from(body)
    if STATUS.size + n > len(body):
        raise DataConnectionError("a refusal whose reason runs past its end")
    end = STATUS.size + n
    return body[STATUS.size : end].decode(errors="replace"), body[end:].decode(errors="replace")


def hello(rank: int, incarnation: int, token: str, session: int = 0) -> bytes:
    """The hello a worker sends first (``session``: the rank's ``JoinResponse.session`` on the shard)."""
    raw = token.encode()
    return HELLO.pack(MAGIC, PROTOCOL, rank, incarnation, session, len(raw)) + raw


def tune(sock: socket.socket) -> None:
    """No Nagle delay: a frame's end record goes out at once."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
