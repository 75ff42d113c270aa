"""A PushPull in progress: a training step's push and pull, one call per shard, overlapping backward.

:class:`PendingPushPull` is made by :meth:`ps_worker.client.PSClient.begin_push_pull`. Gradients
arrive one parameter at a time (autograd hooks); each message of a started stream goes out as soon as
its partitions are ready. It stamps, recovers and accounts through the session
(:class:`~ps_worker.session.Session`), never through the client's own state.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import grpc
import torch

from ps_common import dataconn, frames
from ps_common.channels import is_loopback
from ps_common.codec import torch_dtype
from ps_proto.v1 import ps_pb2
from ps_worker.transport.calls import DataPath, is_stale
from ps_worker.transport.data_link import DataConnection, DataLinkError
from ps_worker.transport.frame_sender import FrameSender, SendOrder, keep_in_order
from ps_worker.transport.request_frames import StartedStream, frames_of

log = logging.getLogger(__name__)


class PendingPushPull:
    """A :meth:`~ps_worker.client.PSClient.push_pull` in progress; made by
    :meth:`~ps_worker.client.PSClient.begin_push_pull`.

    Thread-safe: :meth:`ready` may be called from autograd hooks while gRPC threads send.
    """

    def __init__(self, path: DataPath, out: Mapping[str, torch.Tensor], stream: bool) -> None:
        self.codec = codec = path.require_codec()
        self.path = path
        self.session = path.session
        self.transport = t = path.transport
        self.out = out
        self.flats, self.device_out = path.staging.pull_targets(codec.plan, out)
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._grads: dict[str, torch.Tensor] = {}
        self._ready: set[str] = set()
        self._outs: list[dict[int, frames.OutPartition]] = [{} for _ in range(t.num_shards)]
        self._by_key: dict[str, list[tuple[int, int]]] = {}
        for k, owned in enumerate(codec.owned):
            for i, part in enumerate(owned):
                self._by_key.setdefault(part.key, []).append((k, i))
        self.groups = codec.request_groups  # fixed by the plan, wire dtype and top-k ratio
        # sync: the round this step's gradient is for, fixed now: every shard and every retry gets
        # the same stamp (a recovery that moves a shard's round drops the push there instead)
        self.round = self.session.push_round()
        self.started: dict[int, Any] = {}
        self.sent = [0] * t.num_shards
        # started streams: the frames built as their gradients become ready, and the groups still to build
        self._streams: dict[int, StartedStream] = {}
        self._heads: dict[int, bytes] = {}
        # shards whose partitions go on their data connection as they become ready: (connection,
        # frame number); a shard whose connection failed leaves this map
        self._frames: dict[int, tuple[DataConnection, int]] = {}
        self._order: SendOrder | None = None  # finish(): the frames' order across shards
        if stream:
            for k in range(t.num_shards):
                if self._once(k):
                    continue  # one message: built and sent at finish()
                conn = self._data_connection(k)
                if conn is not None:
                    self._frames[k] = (conn, t.next_sequence())
                else:
                    self._streams[k] = StartedStream(self._cond, list(self.groups[k]), t.timeout)
                    self._heads[k] = self._head(k)
                    self.started[k] = t.push_pull_calls[k](
                        self._streams[k].messages(), timeout=t.timeout, metadata=t.metadata
                    )

    # -------------------------------------------------------------- what goes on the wire
    def _once(self, k: int) -> bool:
        return len(self.groups[k]) == 1 and self.codec.single_response[k]

    def _data_connection(self, k: int) -> DataConnection | None:
        """Shard ``k``'s data connection when this push may use it: a push of one message (the
        whole PushPullOnce call goes on it, top-k too), or a dense one of several (its partitions)."""
        if not self._once(k) and self.codec.compressor is not None:
            return None
        s = self.session
        return self.transport.data_connection(k, s.rank, s.incarnation, s.sessions[k])

    def _send_ready(self, key: str) -> None:
        """Send the partitions of ``key`` to the shards whose frames go on their data connection
        (caller holds ``_lock``); a connection that fails drops out (the push then goes on gRPC)."""
        for k, i in self._by_key.get(key, ()):
            frame = self._frames.get(k)
            if frame is None:
                continue
            conn, sequence = frame
            try:
                self.sent[k] += conn.send_slot(sequence, i, self._out_locked(k, i).values)
            except DataLinkError as exc:
                self.transport.data_failed(k, exc.details())
                del self._frames[k]

    def _out(self, k: int, i: int) -> frames.OutPartition:
        """Shard ``k``'s partition ``i`` as it goes on the wire, made once (top-k updates its
        error-feedback memory once per step, however often the message is sent). A plain cast is
        made outside the lock, so that the sending threads of several shards cast at once."""
        with self._lock:
            made = self._outs[k].get(i)
            if made is not None or self.codec.compressor is not None:
                return self._out_locked(k, i)
            part = self.codec.owned[k][i]
            grad = self._grads[part.key]
        made = self.codec.to_wire(part, grad, compress=False)
        with self._lock:
            return self._outs[k].setdefault(i, made)

    def _out_locked(self, k: int, i: int) -> frames.OutPartition:
        made = self._outs[k].get(i)
        if made is None:
            part = self.codec.owned[k][i]
            made = self._outs[k][i] = self.codec.to_wire(part, self._grads[part.key], compress=True)
        return made

    def _group_ready(self, k: int, g: list[int]) -> bool:
        owned = self.codec.owned[k]
        return all(owned[i].key in self._ready for i in g)

    def _head(self, k: int) -> bytes:
        """The header fields of shard ``k``'s first request message."""
        return self.codec.push_pull_head(self.session.stamp(k, self.round))

    def _messages(self, k: int) -> Iterator[bytes]:
        """Shard ``k``'s request messages, once every gradient is ready (a call made in ``finish()``);
        built as gRPC sends them."""
        work = [[self._out(k, i) for i in g] for g in self.groups[k]]
        return frames_of(work, self._head(k), self.transport.sent, self.sent, k)

    def _build_ready(self, key: str) -> None:
        """Build the frames of started streams whose partitions are now all ready (caller holds
        ``_lock``)."""
        for k, stream in self._streams.items():
            for g in [g for g in stream.unbuilt if self._group_ready(k, g)]:
                m = self.transport.sent(frames.build((self._out_locked(k, i) for i in g), self._heads[k]))
                self._heads[k] = b""
                self.sent[k] += len(m)
                stream.add(g, m)

    # -------------------------------------------------------------- the caller's side
    def ready(self, key: str, grad: torch.Tensor) -> None:
        """The gradient of parameter ``key`` is final (any device; copied to host here if needed).
        For a call already started (during backward), its partitions are cast or top-k selected,
        and the messages or records they complete are built and sent, here in the caller's thread.
        Otherwise they are made as they are sent in ``finish()``: a frame on a data connection
        casts each partition on its sending thread just before it goes out, so the cast of one
        overlaps the sending of the others."""
        flat = grad.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.to("cpu")
        with self._lock:
            self._grads[key] = flat
            self._ready.add(key)
            self._build_ready(key)
            self._send_ready(key)

    def cancel(self) -> None:
        """Abandon this push: cancel the calls started during backward (a shard applies nothing of
        a cancelled call; a frame begun on a data connection is dropped with the connection, which
        the next push opens again); nothing was accounted and the clock stays."""
        for k in list(self._frames):
            self.transport.drop_data(k)
        self._frames.clear()
        for stream in self._streams.values():
            stream.abort()
        for call in self.started.values():
            call.cancel()
        self.started.clear()

    def _attempt(self, k: int, started: Any | None) -> tuple[ps_pb2.PushResponse, int, int, int]:
        t = self.transport
        self.sent[k] = 0 if started is None else self.sent[k]
        conn = self._data_connection(k) if started is None else None
        if conn is not None and not self._once(k):
            return self._attempt_data(k, conn, t.next_sequence())
        if self._order is not None:
            self._order.give_up(k)  # this push goes on gRPC: no turns to take
        if started is not None:
            replies: Iterator[bytes | memoryview] = started
        elif self._once(k):
            if conn is not None:  # the whole call on the data connection, sent from the gradients' memory
                replies = iter([self._call(k, conn, self._once_chunks(k))])
            else:
                (only,) = self._messages(k)
                replies = iter([t.push_pull_once[k](only, timeout=t.timeout, metadata=t.metadata)])
        else:
            replies = t.push_pull_calls[k](self._messages(k), timeout=t.timeout, metadata=t.metadata)
        version, received, answer = self.codec.decode(k, replies, self.flats, t.servers[k], t.received)
        if answer is None:
            raise RuntimeError(f"Shard {t.servers[k]} answered PushPull without the push's answer.")
        self.session.learn(k, answer)
        return answer, version, self.sent[k], received

    def _once_chunks(self, k: int) -> list[bytes | memoryview]:
        """Shard ``k``'s one request message as its buffers (:func:`frames.build_chunks`: the
        partitions' own memory, not joined), counted as sent."""
        (g,) = self.groups[k]
        chunks = frames.build_chunks([self._out(k, i) for i in g], self._head(k))
        n = sum(memoryview(c).nbytes for c in chunks)
        self.sent[k] += n
        if self.transport.metrics is not None:
            self.transport.metrics.sent_bytes.inc(n)
        return chunks

    def _call(self, k: int, conn: DataConnection, request: dataconn.Body) -> memoryview:
        """PushPullOnce ``request`` as a call on shard ``k``'s data connection: the same request and
        response messages as the unary gRPC call, one round trip on the connection.

        Raises:
            grpc.RpcError: the shard refused the call (:class:`~ps_worker.transport.data_link.DataCallError`,
            its code and reason); :class:`DataLinkError` (UNAVAILABLE) when the connection failed:
            the retry goes on gRPC.
        """
        t = self.transport
        try:
            with conn.lock:
                return conn.call(t.next_sequence(), request, t.timeout, t.max_message_bytes)
        except DataLinkError as exc:
            t.data_failed(k, exc.details())
            raise

    def _send_order(self) -> SendOrder | None:
        """The order of this push's frames across shards (:mod:`ps_worker.transport.frame_sender`), when two
        or more shards on other hosts take one on their data connections (not sent during
        backward); their connections then queue little, so that the order holds on the wire."""
        counts: dict[int, int] = {}
        conns = []
        for k in range(self.transport.num_shards):
            if k in self._frames or k in self.started or self._once(k):
                continue
            conn = self._data_connection(k)
            if conn is not None and not is_loopback(conn.host):  # on one machine: nothing to gain
                counts[k] = len(self.codec.owned[k])
                conns.append(conn)
        if len(counts) < 2:
            return None
        for conn in conns:
            keep_in_order(conn)
        return SendOrder(counts)

    def _attempt_data(
        self, k: int, conn: DataConnection, sequence: int, sent_before: int = -1
    ) -> tuple[ps_pb2.PushResponse, int, int, int]:
        """One PushPull with the partitions on shard ``k``'s data connection: the call with the
        header alone, then the frame (from the gradients' memory, on a thread of its own;
        ``sent_before`` >= 0: its partitions went out during backward and only its end is sent
        here) while the answer's values come back on the connection into the weights (a streamed
        round's speculative values too: a round put back sends its own values after them, which
        overwrite them), then the call's answer (version, push's answer).

        Raises:
            grpc.RpcError: the call failed; :class:`DataLinkError` (UNAVAILABLE) when the
            connection did: the retry goes on the gRPC stream.
        """
        t, codec = self.transport, self.codec
        owned = codec.owned[k]
        with conn.lock:
            # the call first: its header reaches the shard while the frame is still being sent
            head = codec.push_pull_head(self.session.stamp(k, self.round), sequence)
            replies = t.push_pull_calls[k](iter([head]), timeout=t.timeout, metadata=t.metadata)
            wire = codec.wire
            targets = []
            for part in owned:
                flat = self.flats[part.key][part.offset : part.offset + part.length]
                targets.append((flat, wire if wire is not None and flat.dtype != wire else flat.dtype))
            # the frame goes out beside the receive: a streamed round answers each partition while
            # the later ones are still on their way (both directions of the link busy at once)
            sending: FrameSender | None = None
            try:
                sending = FrameSender(
                    conn, sequence, len(owned), lambda i: self._out(k, i).values, sent_before, self._order, k
                )
                received = conn.receive(
                    sequence,
                    targets,
                    t.timeout,
                    lambda: replies.done() and replies.code() is not grpc.StatusCode.OK,
                )
                sent = sending.join()
            except DataLinkError as exc:
                replies.cancel()  # the shard applies nothing of a cancelled call
                conn.close()
                if sending is not None:
                    sending.join(quiet=True)
                elif self._order is not None:
                    self._order.give_up(k)
                t.data_failed(k, exc.details())
                raise
            try:
                msg = frames.read(next(replies))
            except grpc.RpcError as exc:
                if exc.code() is grpc.StatusCode.UNAVAILABLE:  # the shard lost the frame, or is stopping
                    t.data_failed(k, exc.details() or "")
                raise
            self.sent[k] = sent
            if msg.ints.get(4, 0) != sequence or 3 not in msg.blobs or received < 0:
                t.data_failed(k, "an answer without its data frame")
                raise DataLinkError(f"Shard {t.servers[k]} answered PushPull {sequence} without its data frame.")
            version = msg.ints.get(1, 0)
            answer = ps_pb2.PushResponse.FromString(msg.blobs[3])
            for _ in replies:  # the stream ends with the status; nothing more comes
                t.data_failed(k, "more than one answer message")
                raise DataLinkError(f"Shard {t.servers[k]} sent more than one message for PushPull {sequence}.")
        if t.metrics is not None:
            t.metrics.sent_bytes.inc(sent)
        t.received(received)
        self.session.learn(k, answer)
        return answer, version, sent, received

    def finish(self) -> int:
        """Send what is left (zeros for parameters without a gradient), wait for every shard,
        copy the new weights into ``out``.

        Returns:
            The lowest version among the shards.

        Raises:
            grpc.RpcError: as :meth:`~ps_worker.client.PSClient.push_pull`.
        """
        t, s = self.transport, self.session
        for spec in self.codec.plan.specs:
            if spec.key not in self._grads:
                self.ready(spec.key, torch.zeros(math.prod(spec.shape), dtype=torch_dtype(spec.dtype)))
        self.path.last_push = _LastPush(self)  # made as the frames are sent; whole once they are
        self.path.last_round = self.round
        self._order = self._send_order()
        for stream in self._streams.values():  # every frame is built: the streams may end
            stream.finish()

        def one(k: int) -> tuple[ps_pb2.PushResponse, int, int, int]:
            frame = self._frames.pop(k, None)
            if frame is not None:
                conn, sequence = frame
                try:
                    return self._attempt_data(k, conn, sequence, self.sent[k])
                except grpc.RpcError:
                    pass  # as a failed stream: the whole push again, with the same stamp
            started = self.started.pop(k, None)
            if started is not None:
                try:
                    return self._attempt(k, started)
                except grpc.RpcError:
                    # a stream started during backward failed: the whole push again, with the
                    # same stamp (a shard that accepted it answers as for a duplicate), recovering
                    pass
            return s.with_recovery(
                k, lambda: self._attempt(k, None), f"PushPull {t.servers[k]}", repush=False, round=self.round
            )

        start = time.perf_counter()
        try:
            results = t.each_shard(one)
        except grpc.RpcError as exc:
            if not is_stale(exc):
                raise
            s.push_refused()  # too stale: the step is done, its gradient refused
            log.info("rank %d: push refused as too stale (%s); pulling", s.rank, exc.details())
            return self.path.pull(self.out)
        finally:
            for stream in self._streams.values():
                stream.finish()
            # from here the gradients may change (zero_grad, the next step's staging): keep the
            # push as it went on the wire, for a repush after a PushLost
            self.path.last_push = [_LastPush(self)[k] for k in range(t.num_shards)]
        self.path.observe("push_pull_duration", start)
        s.pushed_bytes += sum(r[2] for r in results)
        s.pulled_bytes += sum(r[3] for r in results)
        s.account_push([r[0] for r in results])
        return self.path.finish_pull([r[1] for r in results], self.device_out, self.flats)


class _LastPush(Sequence[list[frames.OutPartition]]):
    """Per shard, a push's partitions as they go on the wire, each made on first use (the same
    objects the push sends: :meth:`PendingPushPull._out`)."""

    def __init__(self, pending: PendingPushPull) -> None:
        self.pending = pending

    def __len__(self) -> int:
        return self.pending.transport.num_shards

    @overload
    def __getitem__(self, k: int) -> list[frames.OutPartition]: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[list[frames.OutPartition]]: ...
    def __getitem__(self, k: int | slice) -> list[frames.OutPartition] | Sequence[list[frames.OutPartition]]:
        if isinstance(k, slice):
            return [self[j] for j in range(len(self))[k]]
        owned = self.pending.codec.owned[k]
        return [self.pending._out(k, i) for i in range(len(owned))]
