"""A shard's data connections (:mod:`ps_common.dataconn`): partitions of PushPull beside gRPC.

:class:`DataPlane` listens on ``--data-port``, admits a worker's connection after its hello (the
worker token, as the gRPC calls carry it), and reads each push frame's partitions into tensors of
their own, checking every record against the plan before reading its bytes. A PushPull whose
header names a ``data_sequence`` takes that frame (:meth:`DataPlane.take`) instead of reading
partitions from the gRPC stream, and its answer's values go back on the same connection
(:meth:`DataPlane.send`). Everything else about the call (authorization, the push's checks and
semantics, errors, deadlines) is the gRPC call's.

A connection also carries whole calls (a small model's ``PushPullOnce``,
:data:`ps_common.dataconn.CALL`): the connection's thread runs the call's handler (the servicer's
own method, wrapped by the metrics interceptor) with a :class:`~ps_server.data_calls.CallContext`
standing for gRPC's, and sends the answer or the refusal's status code, reason and details back:
one round trip, no gRPC call, no thread hand-off.

Bounds: at most ``max_connections`` connections (one per rank: a new hello of a rank replaces its
old connection); per connection one frame being read and one complete frame waiting, each at most
the shard's partitions in their parameters' dtypes; a record whose slot, dtype or byte count is
not the plan's closes the connection before any of its bytes are read; a call's request at most
``max_call_bytes`` (the gRPC server's message limit: a longer one is refused with
RESOURCE_EXHAUSTED and the connection closed before its bytes are read), one call at a time.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from ps_common import dataconn
from ps_common.codec import DTYPES, check_finite, decode, dtype_from_proto, wire_dtype_allowed
from ps_common.errors import DataPathError, InvalidRequestError
from ps_common.partition import WirePartition
from ps_common.plan import Plan
from ps_server.data_calls import CallContext, CallHandler, run_call
from ps_server.threads import OwnedThreads

log = logging.getLogger(__name__)

HELLO_SECONDS = 10.0
"""A connection must send its hello within this many seconds."""

SEND_SECONDS = 60.0
"""How long an answer's frame may take to send when the call has no deadline."""

POLL_SECONDS = 0.25
"""How often a waiting PushPull checks that its call is still active."""


@dataclass
class _Conn:
    sock: socket.socket
    rank: int
    incarnation: int
    session: int = 0
    """The rank's session the hello carried (``JoinResponse.session``)."""
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    ready: tuple[int, list[WirePartition]] | None = None
    """The last complete push frame not yet taken: (sequence, partitions in slot order)."""
    filling: tuple[int, dict[int, WirePartition]] | None = None
    """The push frame being read: (sequence, slot -> partition landed so far)."""
    error: str = ""
    """Why the connection closed ("" while open)."""
    loopback: bool = False
    """The worker dialled from a loopback address (its process shares this machine)."""


class DataPlane:
    """The data connections of one shard.

    Args:
        host: address to listen on (the gRPC server's).
        port: TCP port; 0 picks a free one (:attr:`port` says which).
        shard_index: this shard.
        plan_of: the shard's plan now (None before Init).
        token, admin_token: a hello must carry one of them when ``token`` is set.
        max_connections: connections open at once; one more is closed after its hello is refused.
        threads: where the listener and the connections' threads are started (joined at stop).
        counted: called with (bytes received, bytes sent) as frames move (metrics).
        call: the handler of calls on a connection (the servicer's PushPullOnce, wrapped by the
            metrics interceptor, which counts their bytes); None: a call closes the connection.
        max_call_bytes: longest call request accepted (the gRPC server's message limit).
        landed: called (holding no lock of this plane's) each time a push partition lands, so a
            streamed round (:mod:`ps_server.round_stream`) can step it; :meth:`peek` reads them.
        admit: whether (rank, incarnation, session) is the rank's current session on the shard
            (holding no lock of this plane's): checked at each push frame's first record (not: the
            connection closes) and before a hello replaces a rank's connection; None admits all.

    Raises:
        RuntimeError: the port could not be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        shard_index: int,
        plan_of: Callable[[], Plan | None],
        *,
        token: str = "",
        admin_token: str = "",
        max_connections: int = 64,
        threads: OwnedThreads | None = None,
        counted: Callable[[int, int], None] | None = None,
        call: CallHandler | None = None,
        max_call_bytes: int = 64 << 20,
        landed: Callable[[], None] | None = None,
        admit: Callable[[int, int, int], bool] | None = None,
    ) -> None:
        self.shard_index = shard_index
        self._admit = admit or (lambda rank, incarnation, session: True)
        self._landed = landed or (lambda: None)
        self._call = call
        self.max_call_bytes = max_call_bytes
        self.calls = 0
        """Calls answered on the connections (refusals included)."""
        self._plan_of = plan_of
        self._tokens = [t.encode() for t in (token, admin_token) if t] if token else []
        self.max_connections = max_connections
        self._threads = threads or OwnedThreads()
        self._counted = counted or (lambda received, sent: None)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = socket.create_server((host, port), family=family, backlog=max_connections)
        except OSError as exc:
            raise RuntimeError(f"Could not bind the data port {host}:{port}: {exc}; is the port in use?") from exc
        self.port: int = self._listener.getsockname()[1]
        self._cond = threading.Condition()
        self._by_rank: dict[int, _Conn] = {}
        self._open: set[socket.socket] = set()
        self._closed = False
        self._threads.start(self._accept, f"shard{shard_index}-data-listener")

    # ------------------------------------------------------------------ connections
    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._cond:
                if self._closed or len(self._open) >= self.max_connections:
                    full = not self._closed
                    sock.close()
                    if full:
                        log.warning("data connection refused: %d open (the most)", self.max_connections)
                    continue
                self._open.add(sock)
            self._threads.start(functools.partial(self._serve, sock), f"shard{self.shard_index}-data")

    def _serve(self, sock: socket.socket) -> None:
        conn: _Conn | None = None
        try:
            dataconn.tune(sock)
            conn = self._hello(sock)
            if conn is None:
                return
            sock.settimeout(None)  # a connection waits for frames as long as the worker trains
            self._read_frames(conn)
        except (OSError, dataconn.DataConnectionError, InvalidRequestError) as exc:
            if conn is not None:
                self._lost(conn, str(exc))
        finally:
            with self._cond:
                self._open.discard(sock)
                if conn is not None and self._by_rank.get(conn.rank) is conn:
                    del self._by_rank[conn.rank]
                if conn is not None and not conn.error:
                    conn.error = "the worker closed its data connection"
                self._cond.notify_all()
            sock.close()

    def _hello(self, sock: socket.socket) -> _Conn | None:
        deadline = time.monotonic() + HELLO_SECONDS
        magic, protocol, rank, incarnation, session, token_len = dataconn.recv_struct(sock, dataconn.HELLO, deadline)
        if magic != dataconn.MAGIC or protocol != dataconn.PROTOCOL or token_len > dataconn.MAX_TOKEN_BYTES:
            log.warning("data connection closed: not a grpc-ps data connection of protocol %d", dataconn.PROTOCOL)
            return None
        given = bytearray(token_len)
        dataconn.recv_exact(sock, memoryview(given), deadline)
        if self._tokens and not any(hmac.compare_digest(bytes(given), t) for t in self._tokens):
            log.warning("data connection of rank %d closed: wrong token", rank)
            return None
        conn = _Conn(sock, rank, incarnation, session)
        with self._cond:
            taken = rank in self._by_rank
        if taken and not self._admit(rank, incarnation, session):  # only the rank's session replaces its connection
            log.warning("data connection of rank %d closed: not the rank's current session", rank)
            return None
        try:
            conn.loopback = ipaddress.ip_address(sock.getpeername()[0]).is_loopback
        except (OSError, ValueError):
            pass
        with self._cond:
            old = self._by_rank.get(rank)
            self._by_rank[rank] = conn
            self._cond.notify_all()
        if old is not None:
            self._lost(old, "a newer data connection of the same rank replaced it")
        sock.sendall(dataconn.REPLY.pack(dataconn.MAGIC, 0))
        return conn

    def _read_frames(self, conn: _Conn) -> None:
        """Read push frames until the connection closes; each record is checked against the plan
        before its bytes are read, and a complete frame replaces the one waiting (if any)."""
        sock = conn.sock
        sequence: int | None = None
        parts: dict[int, WirePartition] = {}
        received = 0
        while True:
            seq, slot, dtype_code, nbytes = dataconn.recv_struct(sock, dataconn.RECORD)
            if slot == dataconn.CALL:
                if sequence is not None:
                    raise InvalidRequestError(f"call {seq} began before frame {sequence} ended")
                self._serve_call(conn, seq, dtype_code, nbytes)
                continue
            if sequence is not None and seq != sequence:
                raise InvalidRequestError(f"frame {seq} began before frame {sequence} ended")
            if sequence is None and not self._admit(conn.rank, conn.incarnation, conn.session):
                raise InvalidRequestError(
                    f"frame {seq}: the hello's session is not rank {conn.rank}'s current one (join again)"
                )
            sequence = seq
            if slot == dataconn.END:
                if nbytes != len(parts):
                    raise InvalidRequestError(f"frame {seq} ended after {len(parts)} partitions, not {nbytes}")
                with self._cond:
                    conn.ready = (seq, [parts[i] for i in sorted(parts)])
                    conn.filling = None
                    self._cond.notify_all()
                self._landed()
                self._counted(received, 0)
                sequence, parts, received = None, {}, 0
                continue
            owned = self._owned()
            if slot >= len(owned) or slot in parts:
                raise InvalidRequestError(f"frame {seq}: slot {slot} is not one of {len(owned)} or came twice")
            part = owned[slot]
            name = dtype_from_proto(dtype_code)
            plan = self._plan_of()
            assert plan is not None
            param = plan.dtypes[part.key]
            if name != param and not wire_dtype_allowed(name, param):
                raise InvalidRequestError(f"frame {seq}: {name} for a {param} parameter")
            if nbytes != part.length * DTYPES[name].itemsize:
                raise InvalidRequestError(f"frame {seq}: {nbytes} bytes for {part.length} {name} values")
            view = dataconn.byte_view(torch.empty(nbytes, dtype=torch.uint8))
            dataconn.recv_exact(sock, view)
            # checked here, while the frame's later partitions are still arriving; a partition that
            # is not finite goes on unmarked, and the PushPull's Intake refuses it with its message
            try:
                bound = check_finite(decode(view, name, part.length), "")
                finite = True
            except InvalidRequestError:
                finite, bound = False, math.inf
            parts[slot] = WirePartition(part.key, part.offset, part.length, name, view, finite=finite, bound=bound)
            received += nbytes + dataconn.RECORD.size
            with self._cond:
                conn.filling = (seq, dict(parts))
            self._landed()

    def _serve_call(self, conn: _Conn, sequence: int, timeout_ms: int, nbytes: int) -> None:
        """Read call ``sequence``'s request, run the handler here, send its answer.

        Raises:
            InvalidRequestError: no calls are served here, or the request is over the limit (its
                refusal is sent first); the connection closes.
            OSError, DataConnectionError: the connection broke.
        """
        if self._call is None:
            raise InvalidRequestError(f"call {sequence}: this shard takes no calls on its data connections")
        if nbytes > self.max_call_bytes:
            details = (
                f"A call of {nbytes} bytes is over this shard's limit of {self.max_call_bytes} bytes "
                "(--max-message-bytes)."
            )
            exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            self._answer(conn, sequence, exhausted, dataconn.refusal("", details), 5.0)
            raise InvalidRequestError(f"call {sequence}: {details}")
        request = dataconn.buffer(nbytes)
        dataconn.recv_exact(conn.sock, request)
        context = CallContext(timeout_ms / 1000 if timeout_ms else None, lambda: not conn.error, conn.rank)
        code, body = run_call(self._call, request, context, f"call {sequence} of rank {conn.rank}")
        self._answer(conn, sequence, code, body, context.time_remaining())
        with self._cond:  # connection threads answer calls concurrently
            self.calls += 1

    def _answer(self, conn: _Conn, sequence: int, code: int, body: dataconn.Body, timeout: float | None) -> None:
        with conn.send_lock:
            dataconn.send_all(
                conn.sock,
                dataconn.answer(sequence, code, body),
                time.monotonic() + max(1.0, SEND_SECONDS if timeout is None else timeout),
            )

    def _owned(self) -> Sequence:
        plan = self._plan_of()
        if plan is None:
            raise InvalidRequestError("a frame came before the shard was initialized")
        return plan.owned_by(self.shard_index)

    def _lost(self, conn: _Conn, why: str) -> None:
        with self._cond:
            if not conn.error:
                conn.error = why
                log.info("data connection of rank %d closed: %s", conn.rank, why)
            if self._by_rank.get(conn.rank) is conn:
                del self._by_rank[conn.rank]
            self._cond.notify_all()
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # ------------------------------------------------------------------ PushPull
    def take(
        self,
        rank: int,
        incarnation: int,
        sequence: int,
        timeout: float | None,
        active: Callable[[], bool] = lambda: True,
    ) -> list[WirePartition]:
        """Wait for rank's push frame ``sequence`` and take it (partitions in slot order, not yet
        checked for finiteness: the caller's :class:`~ps_server.core.partitions.Intake` does that).

        Raises:
            DataPathError: no connection of that rank and incarnation, it closed, the frame did
                not come within ``timeout`` seconds, or the call ended.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                # a worker's hello is answered once its connection is registered, and it calls after
                # that: no connection of this rank and incarnation now means none is coming
                conn = self._connection(rank, incarnation, sequence)
                if conn.ready is not None and conn.ready[0] == sequence:
                    parts = conn.ready[1]
                    conn.ready = None
                    return parts
                left = POLL_SECONDS if deadline is None else min(POLL_SECONDS, deadline - time.monotonic())
                if left <= 0 or not active():
                    why = "the frame did not come in time"
                    raise DataPathError(
                        f"The partitions of PushPull {sequence} of rank {rank} are not on its data connection "
                        f"({why}); send them on the gRPC stream."
                    )
                self._cond.wait(left)

    def peek(self, rank: int, incarnation: int, sequence: int) -> tuple[dict[int, WirePartition], bool]:
        """The partitions of rank's push frame ``sequence`` landed so far (slot -> partition, not
        yet checked for finiteness), and whether the frame is complete (then :meth:`take` it).

        Raises:
            DataPathError: the shard is stopping, or no connection of that rank and incarnation
                (it closed).
        """
        with self._cond:
            conn = self._connection(rank, incarnation, sequence)
            if conn.ready is not None and conn.ready[0] == sequence:
                return dict(enumerate(conn.ready[1])), True
            if conn.filling is not None and conn.filling[0] == sequence:
                return conn.filling[1], False
            return {}, False

    def loopback(self, rank: int) -> bool:
        """Whether rank's connection comes from a loopback address (False: none, or another host)."""
        with self._cond:
            conn = self._by_rank.get(rank)
            return conn is not None and conn.loopback

    def _connection(self, rank: int, incarnation: int, sequence: int) -> _Conn:
        if self._closed:
            raise DataPathError("The shard is stopping; its data connections are closed.")
        conn = self._by_rank.get(rank)
        if conn is None or conn.incarnation != incarnation:
            raise DataPathError(
                f"Rank {rank} (incarnation {incarnation}) has no data connection to this shard for PushPull "
                f"{sequence}; send PushPull's partitions on the gRPC stream."
            )
        return conn

    def send_records(
        self, rank: int, incarnation: int, sequence: int, buffers: list[bytes | memoryview], timeout: float | None
    ) -> int:
        """Send ``buffers`` (records of answer frame ``sequence``: :func:`ps_common.dataconn.record`,
        markers) on rank's connection within ``timeout`` seconds. Returns the bytes sent.

        Raises:
            DataPathError: no connection of that rank and incarnation, it broke, or the worker did
                not read in time (the connection is closed).
        """
        with self._cond:
            conn = self._connection(rank, incarnation, sequence)
        try:
            with conn.send_lock:
                sent = dataconn.send_all(
                    conn.sock, buffers, time.monotonic() + (SEND_SECONDS if timeout is None else max(0.0, timeout))
                )
        except (OSError, dataconn.DataConnectionError) as exc:
            self._lost(conn, str(exc))
            raise DataPathError(f"The data connection of rank {rank} broke while sending ({exc}).") from exc
        self._counted(0, sent)
        return sent

    def send(
        self,
        rank: int,
        incarnation: int,
        sequence: int,
        slots: Sequence[torch.Tensor],
        timeout: float | None = None,
    ) -> int:
        """Send frame ``sequence`` to rank's connection: ``slots`` are 1-D contiguous CPU tensors
        (the wire dtype) per partition in plan order, sent from their memory, within
        ``timeout`` seconds (None: :data:`SEND_SECONDS`). Returns the bytes sent.

        Raises:
            DataPathError: no connection of that rank and incarnation, it broke, or the worker
                did not read the frame in time (the connection is closed).
        """
        return self.send_records(rank, incarnation, sequence, dataconn.frame(sequence, slots), timeout)

    def close(self) -> None:
        """Stop listening and close every connection (their threads end; waiters get DataPathError)."""
        with self._cond:
            self._closed = True
            conns = list(self._by_rank.values())
            opened = list(self._open)
            self._cond.notify_all()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not, on Linux)
        except OSError:
            pass
        self._listener.close()
        for c in conns:
            self._lost(c, "the shard is stopping")
        for s in opened:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def wire_slots(tensors: Sequence[torch.Tensor], wire: torch.dtype | None, copy: bool = True) -> list[torch.Tensor]:
    """A snapshot's partitions as they go on the data connection: cast to ``wire`` when given
    (new tensors), else copies, or with ``copy=False`` the parameters' own memory (the sender then
    checks the version did not move while it sent). Taken under the shard's lock, sent after it is
    released."""
    return [t.to(wire) if wire is not None and t.dtype != wire else (t.clone() if copy else t) for t in tensors]
