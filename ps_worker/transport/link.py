"""How one shard's PushPull travels: a :class:`Link`, chosen per attempt by :func:`choose_link`.

Two links carry the same request and response messages (``docs/architecture.md#7-gradient-path``):

- :class:`GrpcLink`: the PushPull stream (or the unary PushPullOnce for a push of one message).
- :class:`DataLink`: the shard's raw-TCP data connection (:mod:`ps_common.dataconn`): a push of one
  message goes whole as a call on it; a dense push of several sends its header on the PushPull
  stream and its partitions as a frame on the connection, the answer's values coming back on it.

A data link that fails closes its connection and raises
:class:`~ps_worker.transport.data_link.DataLinkError` (UNAVAILABLE): the retry's :func:`choose_link`
then answers a :class:`GrpcLink` (the transport keeps the connection down for a while), and the
shard, which applies a stamp at most once, answers the same push as usual.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

import grpc
import torch

from ps_common import dataconn, fields, frames
from ps_proto.v1 import ps_pb2
from ps_worker.session import Session
from ps_worker.transport.data_link import DataConnection, DataLinkError
from ps_worker.transport.encoding import WireCodec
from ps_worker.transport.frame_sender import FrameSender, SendOrder
from ps_worker.transport.grpc_link import Transport
from ps_worker.transport.request_frames import StartedStream

Answer = tuple[ps_pb2.PushResponse, int, int, int]
"""A shard's answer to a PushPull: (the push's answer, version, bytes sent, bytes received)."""


class Push(Protocol):
    """What a link needs of the push it carries (:class:`~ps_worker.transport.pushpull.PendingPushPull`)."""

    transport: Transport
    codec: WireCodec
    session: Session
    flats: dict[str, torch.Tensor]
    sent: list[int]
    order: SendOrder | None
    cond: threading.Condition
    groups: list[list[list[int]]]

    def once(self, k: int) -> bool: ...
    def out(self, k: int, i: int) -> frames.OutPartition: ...
    def out_locked(self, k: int, i: int) -> frames.OutPartition: ...
    def group_ready(self, k: int, g: list[int]) -> bool: ...
    def head(self, k: int, data_sequence: int = 0) -> bytes: ...
    def messages(self, k: int) -> Iterator[bytes]: ...
    def once_chunks(self, k: int) -> list[bytes | memoryview]: ...


class Link(Protocol):
    """Shard ``k``'s PushPull of one push, on one path.

    A link may :meth:`begin` during backward (``overlap``): it then takes each gradient as it is
    :meth:`ready` and its first :meth:`attempt` finishes that call; any other attempt sends the
    whole push. Every attempt carries the push's one stamp.
    """

    def begin(self) -> None:
        """Open the call now, before every gradient is ready."""

    def ready(self, key: str) -> bool:
        """The gradient of ``key`` is ready (the push's lock is held): send what it completes.
        False: the link broke (logged); the push goes again through :func:`choose_link`."""

    def end(self) -> None:
        """Every gradient is ready: a begun call may end its request."""

    def cancel(self) -> None:
        """Abandon a begun call: the shard applies nothing of it."""

    def attempt(self) -> Answer:
        """One PushPull; the weights land in the push's ``flats``.

        Raises:
            grpc.RpcError: the call failed or was refused (a data link's own failure is a
                :class:`~ps_worker.transport.data_link.DataLinkError`, UNAVAILABLE).
            RuntimeError: the shard answered without the push's answer.
        """

    def frame_connection(self) -> DataConnection | None:
        """The data connection this push's partitions go on as a frame, or None."""


def choose_link(push: Push, k: int) -> Link:
    """The link shard ``k``'s PushPull takes now: its data connection when the shard offers one and
    the push may use it (a push of one message, top-k too; or a dense push of several), else gRPC.
    The transport answers no connection for ``data_path="grpc"``, TLS, a target without a host, or
    for a while after the connection failed."""
    if push.once(k) or push.codec.compressor is None:
        s = push.session
        conn = push.transport.data_connection(k, s.rank, s.incarnation, s.sessions[k])
        if conn is not None:
            return DataLink(push, k, conn)
    return GrpcLink(push, k)


def _decoded(push: Push, k: int, replies: Iterator[bytes | memoryview]) -> Answer:
    t = push.transport
    version, received, answer = push.codec.decode(k, replies, push.flats, t.servers[k], t.received)
    if answer is None:
        raise RuntimeError(f"Shard {t.servers[k]} answered PushPull without the push's answer.")
    push.session.learn(k, answer)
    return answer, version, push.sent[k], received


class GrpcLink:
    """Shard ``k``'s PushPull on gRPC: the PushPull stream, or PushPullOnce for one message."""

    def __init__(self, push: Push, k: int) -> None:
        self.push, self.k = push, k
        self.stream: StartedStream | None = None
        self.call: Any = None
        self._head = b""

    def begin(self) -> None:
        p, t, k = self.push, self.push.transport, self.k
        self.stream = StartedStream(p.cond, list(p.groups[k]), t.timeout)
        self._head = p.head(k)
        self.call = t.push_pull_calls[k](self.stream.messages(), timeout=t.timeout, metadata=t.call_metadata())

    def ready(self, key: str) -> bool:
        """Build the messages whose partitions are now all ready, for the begun stream."""
        p, k, stream = self.push, self.k, self.stream
        if stream is None:
            return True
        for g in [g for g in stream.unbuilt if p.group_ready(k, g)]:
            m = p.transport.sent(frames.build((p.out_locked(k, i) for i in g), self._head))
            self._head = b""
            p.sent[k] += len(m)
            stream.add(g, m)
        return True

    def end(self) -> None:
        if self.stream is not None:
            self.stream.finish()

    def cancel(self) -> None:
        if self.stream is not None:
            self.stream.abort()
        if self.call is not None:
            self.call.cancel()
            self.call = None

    def attempt(self) -> Answer:
        p, t, k = self.push, self.push.transport, self.k
        begun, self.call = self.call, None
        if begun is None:
            p.sent[k] = 0
        if p.order is not None:
            p.order.give_up(k)  # this push goes on gRPC: no turns to take
        if begun is not None:
            replies: Iterator[bytes | memoryview] = begun
        elif p.once(k):
            (only,) = p.messages(k)
            replies = iter([t.push_pull_once[k](only, timeout=t.timeout, metadata=t.call_metadata())])
        else:
            replies = t.push_pull_calls[k](p.messages(k), timeout=t.timeout, metadata=t.call_metadata())
        return _decoded(p, k, replies)

    def frame_connection(self) -> DataConnection | None:
        return None


class DataLink:
    """Shard ``k``'s PushPull on its data connection ``conn``."""

    def __init__(self, push: Push, k: int, conn: DataConnection) -> None:
        self.push, self.k, self.conn = push, k, conn
        self.sequence: int | None = None
        """The frame number of a begun push's partitions."""
        self._slots: dict[str, list[int]] = {}
        self._ready: queue.SimpleQueue[tuple[int, torch.Tensor] | None] = queue.SimpleQueue()
        self._sending: FrameSender | None = None
        self._until = 0.0

    def begin(self) -> None:
        """Begin the frame during backward: its partitions go out on a thread of their own as
        their gradients are ready (:meth:`ready`), so that backward never waits for the link, and
        the answer's values are received from :meth:`attempt` on, while the rest still goes up."""
        p, k = self.push, self.k
        self.sequence = p.transport.next_sequence()
        for i, part in enumerate(p.codec.owned[k]):
            self._slots.setdefault(part.key, []).append(i)
        self._until = time.monotonic() + self.conn.timeout
        self._sending = FrameSender(self.conn, self.sequence, len(p.codec.owned[k]), self._next_ready, p.order, k)

    def _next_ready(self, i: int) -> tuple[int, torch.Tensor]:
        """The begun frame's i-th partition to send, once its gradient is ready (on the sending thread).

        Raises:
            TimeoutError: none within the push's timeout. ConnectionAbortedError: the push was cancelled.
        """
        try:
            ready = self._ready.get(timeout=max(0.0, self._until - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"partition {i} of frame {self.sequence} was not ready in time") from None
        if ready is None:
            raise ConnectionAbortedError(f"frame {self.sequence} was cancelled")
        return ready

    def ready(self, key: str) -> bool:
        """Queue the partitions of ``key`` for the begun frame's sending thread; False when it failed
        (the connection is closed: the push goes on gRPC)."""
        p, k, sending = self.push, self.k, self._sending
        if sending is None:
            return True
        if sending.error is not None:
            p.transport.data_failed(k, sending.error.details())
            return False
        for i in self._slots.get(key, ()):
            if p.order is not None:
                p.order.add(k)
            self._ready.put((p.codec.slots[k][i], p.out_locked(k, i).values))
        return True

    def end(self) -> None:
        pass

    def cancel(self) -> None:
        """A frame begun on the connection is dropped with it; the next push connects again."""
        if self.sequence is not None:
            self._ready.put(None)
            self.push.transport.drop_data(self.k)

    def attempt(self) -> Answer:
        p, t, k = self.push, self.push.transport, self.k
        begun, self.sequence = self.sequence, None
        if begun is not None:
            return self._frame(begun, self._sending)
        p.sent[k] = 0
        if not p.once(k):
            return self._frame(t.next_sequence())
        if p.order is not None:
            p.order.give_up(k)
        # the whole call on the data connection, sent from the gradients' memory
        return _decoded(p, k, iter([self._call(p.once_chunks(k))]))

    def frame_connection(self) -> DataConnection | None:
        return None if self.push.once(self.k) else self.conn

    def _call(self, request: dataconn.Body) -> memoryview:
        """PushPullOnce ``request`` as a call on the connection: the same request and response
        messages as the unary gRPC call, one round trip.

        Raises:
            grpc.RpcError: the shard refused the call (:class:`~ps_worker.transport.data_link.DataCallError`,
            its code and reason); :class:`DataLinkError` (UNAVAILABLE) when the connection failed.
        """
        t, conn = self.push.transport, self.conn
        try:
            with conn.lock:
                return conn.call(t.next_sequence(), request, t.timeout, t.max_message_bytes)
        except DataLinkError as exc:
            t.data_failed(self.k, exc.details())
            raise

    def _frame(self, sequence: int, sending: FrameSender | None = None) -> Answer:
        """One PushPull with the partitions as frame ``sequence``: the call with the header alone,
        then the frame (from the gradients' memory, on a thread of its own; ``sending``: the frame
        begun during backward, on its way) while the answer's
        values come back on the connection into the weights (a streamed round's speculative values
        too: a round put back sends its own values after them, which overwrite them), then the
        call's answer (version, push's answer).

        Raises:
            grpc.RpcError: the call failed; :class:`DataLinkError` (UNAVAILABLE) when the connection did.
        """
        p, t, k, conn = self.push, self.push.transport, self.k, self.conn
        owned = p.codec.owned[k]
        with conn.lock:
            # the call first: its header reaches the shard while the frame is still being sent
            replies = t.push_pull_calls[k](iter([p.head(k, sequence)]), timeout=t.timeout, metadata=t.call_metadata())
            wire = p.codec.wire
            targets = []
            for part in owned:
                flat = p.flats[part.key][part.offset : part.offset + part.length]
                targets.append((flat, wire if wire is not None and flat.dtype != wire else flat.dtype))
            # the frame goes out beside the receive: a streamed round answers each partition while
            # the later ones are still on their way (both directions of the link busy at once)
            if sending is None:
                slots = p.codec.slots[k]
                sending = FrameSender(conn, sequence, len(owned), lambda i: (slots[i], p.out(k, i).values), p.order, k)
            try:
                received = conn.receive(
                    sequence, targets, t.timeout, lambda: replies.done() and replies.code() is not grpc.StatusCode.OK
                )
                sent = sending.join()
            except DataLinkError as exc:
                replies.cancel()  # the shard applies nothing of a cancelled call
                conn.close()
                sending.join(quiet=True)
                t.data_failed(k, exc.details())
                raise
            try:
                msg = frames.read(next(replies))
            except grpc.RpcError as exc:
                if exc.code() is grpc.StatusCode.UNAVAILABLE:  # the shard lost the frame, or is stopping
                    t.data_failed(k, exc.details() or "")
                raise
            p.sent[k] = sent
            if msg.ints.get(fields.DATA_SEQUENCE, 0) != sequence or fields.PUSH_ANSWER not in msg.blobs or received < 0:
                t.data_failed(k, "an answer without its data frame")
                raise DataLinkError(f"Shard {t.servers[k]} answered PushPull {sequence} without its data frame.")
            version = msg.ints.get(fields.VERSION, 0)
            answer = ps_pb2.PushResponse.FromString(msg.blobs[fields.PUSH_ANSWER])
            for _ in replies:  # the stream ends with the status; nothing more comes
                t.data_failed(k, "more than one answer message")
                raise DataLinkError(f"Shard {t.servers[k]} sent more than one message for PushPull {sequence}.")
        if t.metrics is not None:
            t.metrics.sent_bytes.inc(sent)
        t.received(received)
        p.session.learn(k, answer)
        return answer, version, sent, received
