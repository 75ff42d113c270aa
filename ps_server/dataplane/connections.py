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
own method, wrapped by the metrics interceptor) with a :class:`~ps_server.dataplane.calls.CallContext`
standing for gRPC's, and sends the answer or the refusal's status code, reason and details back:
one round trip, no gRPC call, no thread hand-off.

Bounds: at most ``max_connections`` connections (one per rank: a new hello of a rank replaces its
old connection); a hello of a rank outside the cluster is refused (:data:`REFUSED`); a push frame
is read only from a live member (the rank joined under the hello's incarnation and not evicted, or
left), checked at the frame's first record: any other closes the connection before a byte is
parked; per connection one frame being read and one complete frame waiting, each at most the
shard's partitions in their parameters' dtypes, and at most ``max_parked_bytes`` parked over all
connections; a parked frame expires ``frame_timeout`` seconds after its last partition landed (or
a call last looked at it): a complete one is dropped, a partial one closes its connection; a
record whose slot, dtype or byte count is not the plan's closes the connection before any of its
bytes are read; a call's request at most ``max_call_bytes`` (the gRPC server's message limit: a
longer one is refused with RESOURCE_EXHAUSTED and the connection closed before its bytes are read),
one call at a time. Refused connections are counted (``refused``) and logged at WARNING at most
once per :data:`WARN_SECONDS`, with the count of those not logged.
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
from ps_common.errors import DataPathError, InvalidRequestError, PSError
from ps_common.partition import WirePartition
from ps_common.plan import Plan
from ps_server.dataplane.calls import CallContext, CallHandler, run_call
from ps_server.service.rank_tokens import RankTokens
from ps_server.threads import OwnedThreads

log = logging.getLogger(__name__)

HELLO_SECONDS = 10.0
"""A connection must send its hello within this many seconds."""

SEND_SECONDS = 60.0
"""How long an answer's frame may take to send when the call has no deadline."""

POLL_SECONDS = 0.25
"""How often a waiting PushPull checks that its call is still active."""

WARN_SECONDS = 10.0
"""At most one WARNING line per this many seconds about refused connections (the rest are counted
and their number said in the next line)."""

REFUSED = grpc.StatusCode.INVALID_ARGUMENT.value[0]
"""The hello reply's status when the rank is outside the cluster (0: accepted)."""


class RateLimitedWarnings:
    """WARNING lines at most once per ``seconds``; the lines held back are counted and their
    number is appended to the next line logged.

    Args:
        logger: where the lines go.
        seconds: the shortest interval between two lines.
        now: monotonic clock in seconds.
    """

    def __init__(self, logger: logging.Logger, seconds: float, now: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._seconds = seconds
        self._now = now
        self._next = -math.inf
        self._held = 0
        self._lock = threading.Lock()

    def warning(self, message: str, *args: object) -> bool:
        """Log ``message % args`` unless a line went out less than ``seconds`` ago; returns
        whether it was logged."""
        with self._lock:
            now = self._now()
            if now < self._next:
                self._held += 1
                return False
            held, self._held, self._next = self._held, 0, now + self._seconds
        more = f" ({held} more refused in the last {self._seconds:g} s, not logged)" if held else ""
        self._log.warning(message + "%s", *args, more)
        return True


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
    ready_bytes: int = 0
    ready_at: float = 0.0
    """When ``ready`` completed or a call last looked at it (``time.monotonic()``)."""
    filling: tuple[int, dict[int, WirePartition]] | None = None
    """The push frame being read: (sequence, slot -> partition landed so far)."""
    filling_bytes: int = 0
    """Bytes allocated for the frame being read (landed, and the partition arriving)."""
    filling_at: float = 0.0
    """When a partition of the frame being read last began or landed, or a call last looked at it."""
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
        rank_tokens: per-rank tokens (``--rank-tokens``): a hello of a rank that has one must carry
            it (or the admin token); ``token`` is then accepted only for ranks without one.
        max_connections: connections open at once; one more is closed after its hello is refused.
        threads: where the listener and the connections' threads are started (joined at stop).
        counted: called with (bytes received, bytes sent) as frames move (metrics).
        call: the handler of calls on a connection (the servicer's PushPullOnce, wrapped by the
            metrics interceptor, which counts their bytes); None: a call closes the connection.
        max_call_bytes: longest call request accepted (the gRPC server's message limit).
        landed: called (holding no lock of this plane's) each time a push partition lands, so a
            streamed round (:mod:`ps_server.shard.round_stream`) can step it; :meth:`peek` reads them.
        member: called (holding no lock of this plane's) with (rank, incarnation) at a hello and at
            each push frame's first record; raises InvalidRequestError when the rank is outside
            the cluster (the hello is refused), another PSError when it is not a live member under
            that incarnation (the frame is refused, the connection closed). None: every rank.
        frame_timeout: seconds a parked frame (complete, or being read) may wait without a
            partition landing or a call looking at it; then it is released.
        max_parked_bytes: called for the most bytes of push frames parked over all connections
            at once (0: no bound); a partition beyond it closes its connection before its bytes
            are read.
        refused: called once per connection refused (wrong token, a rank outside the cluster or
            not a live member, over a bound).
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
        rank_tokens: RankTokens | None = None,
        max_connections: int = 64,
        threads: OwnedThreads | None = None,
        counted: Callable[[int, int], None] | None = None,
        call: CallHandler | None = None,
        max_call_bytes: int = 64 << 20,
        landed: Callable[[], None] | None = None,
        member: Callable[[int, int], None] | None = None,
        frame_timeout: float = 30.0,
        max_parked_bytes: Callable[[], int] = lambda: 0,
        refused: Callable[[], None] | None = None,
        admit: Callable[[int, int, int], bool] | None = None,
    ) -> None:
        self.shard_index = shard_index
        self._member = member or (lambda rank, incarnation: None)
        self._admit = admit or (lambda rank, incarnation, session: True)
        self.frame_timeout = frame_timeout
        self._max_parked_bytes = max_parked_bytes
        self._refused = refused or (lambda: None)
        self._warnings = RateLimitedWarnings(log, WARN_SECONDS)
        self.expired = 0
        """Parked frames released after :attr:`frame_timeout` (complete or partial)."""
        self._landed = landed or (lambda: None)
        self._call = call
        self.max_call_bytes = max_call_bytes
        self.calls = 0
        """Calls answered on the connections (refusals included)."""
        self._plan_of = plan_of
        self._tokens = [t.encode() for t in (token, admin_token) if t] if token else []
        self._shared = token.encode()
        self._admin = admin_token.encode()
        self._rank_tokens = rank_tokens
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
        self._threads.start(self._expire, f"shard{shard_index}-data-expiry")

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
                        self._refuse("data connection refused: %d open (the most)", self.max_connections)
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
                if conn is not None:
                    conn.error = conn.error or "the worker closed its data connection"
                    conn.ready, conn.filling, conn.ready_bytes, conn.filling_bytes = None, None, 0, 0
                self._cond.notify_all()
            sock.close()

    def _hello(self, sock: socket.socket) -> _Conn | None:
        deadline = time.monotonic() + HELLO_SECONDS
        magic, protocol, rank, incarnation, session, token_len = dataconn.recv_struct(sock, dataconn.HELLO, deadline)
        if magic != dataconn.MAGIC or protocol != dataconn.PROTOCOL or token_len > dataconn.MAX_TOKEN_BYTES:
            self._refuse("data connection closed: not a grpc-ps data connection of protocol %d", dataconn.PROTOCOL)
            return None
        given = bytearray(token_len)
        dataconn.recv_exact(sock, memoryview(given), deadline)
        if not self._token_admits(rank, bytes(given)):
            self._refuse("data connection of rank %d closed: wrong token", rank)
            return None
        try:
            self._member(rank, incarnation)
        except InvalidRequestError as exc:  # outside the cluster: no frame of it can ever be taken
            self._refuse("data connection of rank %d refused: %s", rank, exc)
            sock.sendall(dataconn.REPLY.pack(dataconn.MAGIC, REFUSED))
            return None
        except PSError:
            pass  # not live now: each frame's first record is checked
        conn = _Conn(sock, rank, incarnation, session)
        with self._cond:
            taken = rank in self._by_rank
        if taken and not self._admit(rank, incarnation, session):  # only the rank's session replaces its connection
            self._refuse("data connection of rank %d closed: not the rank's current session", rank)
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

    def _token_admits(self, rank: int, given: bytes) -> bool:
        """Whether a hello of ``rank`` with the token ``given`` may open a connection: with rank
        tokens, the rank's own token (or the admin token; the shared token only for a rank without
        one of its own); otherwise one of the tokens, when there are any. Compared in constant time."""
        if self._rank_tokens is None:
            return not self._tokens or any(hmac.compare_digest(given, t) for t in self._tokens)
        own = self._rank_tokens.token_of(rank)
        admin = bool(self._admin) and hmac.compare_digest(given, self._admin)
        if own is not None:
            return hmac.compare_digest(given, own.encode()) or admin
        return admin or (bool(self._shared) and hmac.compare_digest(given, self._shared))

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
            if sequence is None:
                self._check_member(conn, seq)
                if not self._admit(conn.rank, conn.incarnation, conn.session):
                    self._refuse(
                        "data connection of rank %d closed at frame %d: not its current session", conn.rank, seq
                    )
                    raise InvalidRequestError(
                        f"frame {seq}: the hello's session is not rank {conn.rank}'s current one (join again)"
                    )
            sequence = seq
            if slot == dataconn.END:
                if nbytes != len(parts):
                    raise InvalidRequestError(f"frame {seq} ended after {len(parts)} partitions, not {nbytes}")
                with self._cond:
                    conn.ready = (seq, [parts[i] for i in sorted(parts)])
                    conn.ready_bytes, conn.ready_at = conn.filling_bytes, time.monotonic()
                    conn.filling, conn.filling_bytes = None, 0
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
            self._park(conn, seq, nbytes)
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
                conn.filling, conn.filling_at = (seq, dict(parts)), time.monotonic()
            self._landed()

    def _check_member(self, conn: _Conn, sequence: int) -> None:
        """Refuse frame ``sequence`` unless the connection's rank is a live member under its
        incarnation (before any of its bytes are read).

        Raises:
            InvalidRequestError: it is not (the connection closes).
        """
        try:
            self._member(conn.rank, conn.incarnation)
        except PSError as exc:
            self._refuse("data connection of rank %d closed at frame %d: %s", conn.rank, sequence, exc)
            raise InvalidRequestError(f"frame {sequence} of a rank that is not a live member: {exc}") from None

    def _park(self, conn: _Conn, sequence: int, nbytes: int) -> None:
        """Count ``nbytes`` more of the frame being read, within :attr:`max_parked_bytes`.

        Raises:
            InvalidRequestError: over the bound (the connection closes, the frame is dropped).
        """
        limit = self._max_parked_bytes()
        with self._cond:
            parked = sum(c.ready_bytes + c.filling_bytes for c in self._by_rank.values())
            if limit and parked + nbytes > limit:
                over = True
            else:
                over = False
                conn.filling_bytes += nbytes
                conn.filling_at = time.monotonic()
        if over:
            self._refuse(
                "data connection of rank %d closed at frame %d: %d bytes more would park %d, over the bound of %d",
                conn.rank,
                sequence,
                nbytes,
                parked + nbytes,
                limit,
            )
            raise InvalidRequestError(f"frame {sequence}: over the shard's bound of {limit} parked bytes")

    @property
    def parked_bytes(self) -> int:
        """Bytes of push frames parked now (complete and being read) over all connections."""
        with self._cond:
            return sum(c.ready_bytes + c.filling_bytes for c in self._by_rank.values())

    def _refuse(self, message: str, *args: object) -> None:
        self._refused()
        self._warnings.warning(message, *args)

    def _expire(self) -> None:
        """Release parked frames :attr:`frame_timeout` seconds old (the plane's expiry thread)."""
        period = min(1.0, self.frame_timeout / 4)
        while True:
            stale: list[_Conn] = []
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                for conn in self._by_rank.values():
                    if conn.ready is not None and now - conn.ready_at > self.frame_timeout:
                        log.info("data connection of rank %d: frame %d expired untaken", conn.rank, conn.ready[0])
                        conn.ready, conn.ready_bytes = None, 0
                        self.expired += 1
                    if conn.filling_bytes and now - conn.filling_at > self.frame_timeout:
                        stale.append(conn)
                        self.expired += 1
                self._cond.wait(period)
            for conn in stale:
                self._lost(conn, f"its frame was not complete within {self.frame_timeout:g} s")

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
        # the call is active while its connection is: a worker that went away ends the call's waits
        active = lambda: not conn.error and _peer_open(conn.sock)  # noqa: E731
        context = CallContext(timeout_ms / 1000 if timeout_ms else None, active, conn.rank)
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
                    conn.ready, conn.ready_bytes = None, 0
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
                conn.ready_at = time.monotonic()  # a call is at it: not parked
                return dict(enumerate(conn.ready[1])), True
            if conn.filling is not None and conn.filling[0] == sequence:
                conn.filling_at = time.monotonic()
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


def _peer_open(sock: socket.socket) -> bool:
    """Whether the worker still holds its end of ``sock`` (no EOF or error waiting to be read); read
    by the connection's own thread only, while it runs a call (the worker sends nothing meanwhile)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return True
    except OSError:
        return False


def wire_slots(tensors: Sequence[torch.Tensor], wire: torch.dtype | None, copy: bool = True) -> list[torch.Tensor]:
    """A snapshot's partitions as they go on the data connection: cast to ``wire`` when given
    (new tensors), else copies, or with ``copy=False`` the parameters' own memory (the sender then
    checks the version did not move while it sent). Taken under the shard's lock, sent after it is
    released."""
    return [t.to(wire) if wire is not None and t.dtype != wire else (t.clone() if copy else t) for t in tensors]
