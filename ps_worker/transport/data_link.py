"""The worker's end of a shard's data connection (:mod:`ps_common.dataconn`).

A :class:`DataConnection` sends a PushPull's partitions from the gradient tensors' memory and
receives the answer's values straight into the weights (``recv_into`` the parameter's memory when
the wire dtype is the parameter's; through one buffer of the wire dtype otherwise). Any failure
closes it and raises :class:`DataLinkError`, a ``grpc.RpcError`` with code UNAVAILABLE: the
caller's retry sends the same push (same stamp) on the gRPC stream, and the shard, which applies a
push at most once, answers it as usual.

:meth:`DataConnection.call` sends a whole PushPullOnce request (a small model's step) and reads its
answer; a refusal raises :class:`DataCallError` with the shard's status code, details and
``ps-reason``, as the gRPC call would.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence

import grpc
import torch

from ps_common import dataconn
from ps_common.codec import dtype_name, dtype_to_proto
from ps_common.errors import REASON_KEY, StatusError

log = logging.getLogger(__name__)

CONNECT_SECONDS = 5.0
"""Connecting and the hello's answer take at most this long; then the shard is used over gRPC alone."""


class DataCallError(StatusError):
    """A call on the data connection ended with a status other than OK, carried as a gRPC call
    carries it (code, details, ``ps-reason``): the shard's refusal (the connection stays open), or
    :class:`DataLinkError`."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: str = "") -> None:
        super().__init__(code, details, ((REASON_KEY, reason),) if reason else ())


class DataLinkError(DataCallError):
    """The data connection itself failed (UNAVAILABLE, retried over gRPC)."""

    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, details)


GIVE_UP_POLL_MS = 50
"""While no answer record arrives, how often (ms) a receive asks whether its call ended."""


CODES = {c.value[0]: c for c in grpc.StatusCode}
"""A status code's value (as a call's answer carries it) -> the code."""


def host_of(address: str) -> str | None:
    """The host part of ``host:port`` or ``[v6]:port``; None for other gRPC targets (``dns:///``,
    ``unix:``), which get no data connection."""
    if "://" in address or address.startswith("unix:"):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class DataConnection:
    """One open data connection to a shard.

    Args:
        host, port: the shard's host (as the worker dials its gRPC address) and JoinResponse.data_port.
        rank, incarnation: this worker's (the hello binds the connection to them).
        token: the worker token the gRPC calls carry ("" for none).
        timeout: seconds a frame may take to send (the shard stops reading: DataLinkError).
        session: the rank's ``JoinResponse.session`` on the shard (the hello carries it).

    Raises:
        DataLinkError: the connection or the hello failed within :data:`CONNECT_SECONDS`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        incarnation: int,
        token: str = "",
        timeout: float = 60.0,
        session: int = 0,
    ) -> None:
        self.address = f"{host}:{port}"
        self.host = host
        self.ordered = False
        """Its send buffer is kept small for frames sent in order (:mod:`ps_worker.transport.frame_sender`)."""
        self.timeout = timeout
        """Seconds a frame may take to send (the PushPull's deadline)."""
        self.rank = rank
        self.incarnation = incarnation
        self.session = session
        self.lock = threading.Lock()
        self.closed = False
        self._buffers: dict[int, torch.Tensor] = {}
        try:
            self.sock = socket.create_connection((host, port), timeout=CONNECT_SECONDS)
        except OSError as exc:
            raise DataLinkError(f"data connection to {self.address} failed: {exc}") from exc
        try:
            dataconn.tune(self.sock)
            self.sock.sendall(dataconn.hello(rank, incarnation, token, session))
            magic, status = dataconn.recv_struct(self.sock, dataconn.REPLY, time.monotonic() + CONNECT_SECONDS)
            if magic != dataconn.MAGIC or status != 0:
                raise dataconn.DataConnectionError(f"refused the hello (status {status})")
        except (OSError, dataconn.DataConnectionError) as exc:
            self.close()
            raise DataLinkError(f"data connection to {self.address}: {exc}") from exc

    def send_slot(self, sequence: int, slot: int, values: torch.Tensor) -> int:
        """Send partition ``slot`` of frame ``sequence`` alone (1-D CPU tensor in its wire dtype,
        sent from its memory), from a :class:`~ps_worker.transport.frame_sender.FrameSender`'s
        thread: in slot order, or in the order the gradients are ready during backward. Returns
        bytes sent.

        Raises:
            DataLinkError: the connection broke (it is closed).
        """
        return self._send(dataconn.record(sequence, slot, values.contiguous()))

    def send_end(self, sequence: int, count: int) -> int:
        """End frame ``sequence`` after its ``count`` partitions. Returns bytes sent.

        Raises:
            DataLinkError: the connection broke (it is closed).
        """
        return self._send([dataconn.end(sequence, count)])

    def _send(self, buffers: list[bytes | memoryview]) -> int:
        try:
            return dataconn.send_all(self.sock, buffers, time.monotonic() + self.timeout)
        except (OSError, ValueError, dataconn.DataConnectionError) as exc:  # ValueError: closed meanwhile
            self.close()
            raise DataLinkError(f"data connection to {self.address} broke while sending: {exc}") from exc

    def receive(
        self,
        sequence: int,
        targets: Sequence[tuple[torch.Tensor, torch.dtype]],
        timeout: float,
        gave_up: Callable[[], bool] = lambda: False,
    ) -> int:
        """Receive the answer of PushPull ``sequence`` (:mod:`ps_common.dataconn`) into ``targets``:
        per partition in plan order, the 1-D CPU tensor slice of the weights it fills and the dtype
        it comes in (the parameter's, or the wire dtype: then through a buffer and a cast).

        A frame's partitions come in plan order. A streamed round's speculative values
        (:data:`~ps_common.dataconn.SPECULATE`, then slots in any order) go into the targets too,
        as they come: if the round then closes otherwise than it was streamed, the shard sends an
        :data:`~ps_common.dataconn.ABORT` (code 1) and the round's own values as a frame, which
        overwrite every slot; if the call fails (ABORT code 0), its retry's answer does. The
        weights hold the version only once the call answered OK, as with a frame.

        Args:
            gave_up: polled while no record is arriving; True (the call ended with an error and
                nothing more will come) ends the wait: returns -1.

        Returns:
            Bytes received; -1 when no whole answer came (the call's status says why).

        Raises:
            DataLinkError: the connection broke, timed out after ``timeout`` seconds, or sent
                something other than the answer expected (it is closed).
        """
        deadline = time.monotonic() + timeout
        received = 0
        speculative = False
        filled: set[int] = set()
        try:
            while True:
                if not self._readable(deadline, gave_up):
                    return -1
                seq, slot, code, nbytes = dataconn.recv_struct(self.sock, dataconn.RECORD, deadline)
                if seq < sequence and slot == dataconn.ABORT and not nbytes:
                    continue  # an earlier call's end that came after its status: nothing to read
                if seq != sequence:
                    raise dataconn.DataConnectionError(f"expected the answer of PushPull {sequence}, got frame {seq}")
                if slot == dataconn.SPECULATE and not speculative and not filled:
                    speculative = True
                    continue
                if slot == dataconn.ABORT and not nbytes and code in (0, 1):
                    if code == 0:
                        return -1
                    speculative, filled = False, set()  # the round's values follow as a frame
                    continue
                if slot == dataconn.END:
                    if nbytes != len(targets) or len(filled) != len(targets):
                        raise dataconn.DataConnectionError(
                            f"frame {sequence} ended after {len(filled)} of {len(targets)} partitions"
                        )
                    return received
                if slot >= len(targets) or slot in filled or (not speculative and slot != len(filled)):
                    raise dataconn.DataConnectionError(f"partition {slot} of frame {sequence} out of place")
                target, wire = targets[slot]
                want = target.numel() * wire.itemsize
                if (code, nbytes) != (dtype_to_proto(dtype_name(wire)), want):
                    raise dataconn.DataConnectionError(
                        f"expected partition {slot} of frame {sequence} as {want} bytes of {wire}, got {nbytes} "
                        f"bytes of dtype {code}"
                    )
                if wire == target.dtype and target.is_contiguous():
                    dataconn.recv_exact(self.sock, dataconn.byte_view(target), deadline)
                else:
                    buf = self._buffer(slot, target.numel(), wire)
                    dataconn.recv_exact(self.sock, dataconn.byte_view(buf), deadline)
                    target.copy_(buf)
                filled.add(slot)
                received += nbytes
        except (OSError, ValueError, dataconn.DataConnectionError) as exc:  # ValueError: closed meanwhile
            self.close()
            raise DataLinkError(f"data connection to {self.address} failed while receiving: {exc}") from exc

    def _readable(self, deadline: float, gave_up: Callable[[], bool]) -> bool:
        """Wait until a record begins to arrive (True), or ``gave_up()`` (False), by ``deadline``."""
        poll = select.poll()
        poll.register(self.sock, select.POLLIN)
        while not poll.poll(GIVE_UP_POLL_MS):
            if gave_up():
                return bool(poll.poll(0))
            if time.monotonic() > deadline:
                raise dataconn.DataConnectionError("timed out waiting for the answer's values")
        return True

    def _buffer(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """This connection's receive buffer for ``slot`` (kept from call to call)."""
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._buffers[slot] = torch.empty(numel, dtype=dtype)
        return buf

    def call(self, sequence: int, request: dataconn.Body, timeout: float, max_answer_bytes: int) -> memoryview:
        """Call ``sequence``: send ``request`` (a PushPullOnce request message: one buffer, or its
        buffers in order, sent without joining them) and return the response message (a fresh
        buffer, read in place), within ``timeout`` seconds (the shard gets the same deadline).

        Raises:
            DataCallError: the shard refused the call (its code, details and reason; the
                connection stays open).
            DataLinkError: the connection broke, the answer did not come in time, or it is not the
                call's (over ``max_answer_bytes``, another sequence); the connection is closed.
        """
        deadline = time.monotonic() + timeout
        self._send(dataconn.call(sequence, request, timeout))
        try:
            seq, slot, code, nbytes = dataconn.recv_struct(self.sock, dataconn.RECORD, deadline)
            if (seq, slot) != (sequence, dataconn.CALL) or nbytes > max_answer_bytes or code not in CODES:
                raise dataconn.DataConnectionError(
                    f"expected the answer of call {sequence}, got slot {slot} of frame {seq} (code {code}, "
                    f"{nbytes} bytes)"
                )
            body = dataconn.buffer(nbytes)
            dataconn.recv_exact(self.sock, body, deadline)
            if code:
                reason, details = dataconn.parse_refusal(bytes(body))
        except (OSError, ValueError, dataconn.DataConnectionError) as exc:  # ValueError: closed meanwhile
            self.close()
            raise DataLinkError(f"data connection to {self.address} failed while calling: {exc}") from exc
        if code:
            raise DataCallError(CODES[code], details, reason)
        return body

    def close(self) -> None:
        """Close the socket (idempotent)."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a send or receive of another thread
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
