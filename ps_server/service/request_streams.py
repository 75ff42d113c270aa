"""Reading a client's request stream: its header first, checked against the shard before anything
else is read, then each partition checked against the plan as it arrives.

A stream is refused at its first bad frame (not initialized, another plan, a slice this shard does
not own, a repeated partition, more bytes than the plan's share of this shard takes), so a call
never holds more than about that share (:meth:`~ps_common.plan.Plan.request_bytes`), whatever
the client sends and for however long.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ps_common import fields, frames
from ps_common.errors import InvalidRequestError
from ps_common.partition import WirePartition
from ps_common.plan import Plan
from ps_server.core.partitions import Admitted, Intake


@dataclass
class Request:
    """A read request stream: its parsed ``header``, its partitions as its intake checked and read
    them, and its first message (whose other fields, e.g. PushPull's ``wire_dtype``, are in ``first.ints``)."""

    header: Any
    parts: Admitted
    first: frames.Message

    @property
    def plan(self) -> Plan:
        """The plan the header was checked against (``open_``'s :class:`Intake`): passed on, not checked again."""
        return self.parts.intake.plan


def read_request(
    request_iterator: Iterator[bytes | memoryview],
    what: str,
    header_cls: type[Any],
    open_: Callable[[Any], Intake],
    packed: bool,
    count: Callable[[int], None],
) -> Request:
    """Read a stream of hand-read frames (:mod:`ps_common.frames`).

    Args:
        request_iterator: the call's messages, as bytes.
        what: the method's name, for messages.
        header_cls: the header's protobuf class.
        open_: called with the header as soon as it is complete, before any partition is read:
            checks it against the shard (initialized, plan digest, rank) and returns the
            :class:`Intake` the partitions are checked with.
        packed: the header and partitions may share a message and a message may carry several
            partitions (PushPull); otherwise (Init, Push, Exchange: a oneof) each message is a
            header or one partition.
        count: called with each message's size in bytes, as it arrives.

    Returns:
        The header, the partitions (each checked; dense values finite) and the first message.

    Raises:
        InvalidRequestError: malformed messages, a header missing, repeated or after partitions,
            a bad partition, or more bytes than the plan allows. What ``open_`` raises.
    """
    reader = _Reader(what, header_cls, open_, packed)
    for raw in request_iterator:
        count(len(raw))
        reader.feed(raw)
    if reader.first is None:
        raise InvalidRequestError(f"The {what} stream was empty; send a header, then partitions.")
    assert reader.intake is not None  # the first message opened it
    return Request(reader.header, Admitted(reader.intake, reader.parts), reader.first)


class _Reader:
    def __init__(self, what: str, header_cls: type[Any], open_: Callable[[Any], Intake], packed: bool) -> None:
        self.what = what
        self.header_cls = header_cls
        self.open_ = open_
        self.packed = packed
        self.header: Any = None
        self.header_bytes = 0
        self.intake: Intake | None = None
        self.first: frames.Message | None = None
        self.parts: list[WirePartition] = []
        self._raw_size = 0
        self._is_first = True

    def _open(self, msg: frames.Message) -> Intake:
        """Parse the header of the first message and open the intake; count the whole message."""
        raw = msg.blobs.get(fields.HEADER)
        if raw is None:
            raise InvalidRequestError(f"A {self.what} stream must start with a header message.")
        self.header, self.header_bytes = msg.sub(fields.HEADER, self.header_cls), len(raw)
        intake = self.intake = self.open_(self.header)
        intake.charge(self._raw_size)
        return intake

    def _check(self, msg: frames.Message, part: WirePartition) -> WirePartition:
        """Called by :func:`frames.read` on each partition as it is read."""
        if not self.packed and (msg.partitions or fields.HEADER in msg.blobs):
            raise InvalidRequestError(f"A {self.what} message carries a header or one partition, not both.")
        intake = self.intake
        if intake is None:
            intake = self._open(msg)
        elif not msg.partitions and not self._is_first and fields.HEADER in msg.blobs:
            raise InvalidRequestError(f"A {self.what} stream carries one header, then only partitions.")
        return intake.add(part)

    def feed(self, raw: bytes | memoryview) -> None:
        """Read one message of the stream.

        Raises:
            InvalidRequestError: see :func:`read_request`.
        """
        self._is_first = self.first is None
        self._raw_size = len(raw)
        if self.intake is not None:
            self.intake.charge(len(raw))  # before it is parsed
        msg = frames.read(raw, self._check)
        if self._is_first:
            if self.intake is None:  # a header alone
                self._open(msg)
            elif len(msg.blobs.get(fields.HEADER, b"")) != self.header_bytes:  # more header after partitions
                raise InvalidRequestError(f"A {self.what} stream carries one header, then only partitions.")
            self.first = msg
        elif fields.HEADER in msg.blobs or not msg.partitions:
            raise InvalidRequestError(f"A {self.what} stream carries one header, then only partitions.")
        self.parts += msg.partitions
