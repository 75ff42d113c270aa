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

Its parts own their state: ``connection`` (one worker's connection), ``hello``, ``records`` (a
connection's records), ``parked`` (parked frames), ``calls`` and ``refusals`` (modules of this package).
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

import torch

from ps_common import dataconn
from ps_common.errors import DataPathError, InvalidRequestError
from ps_common.partition import WirePartition
from ps_common.plan import Plan
from ps_server.dataplane.calls import CallHandler, CallServer
from ps_server.dataplane.connection import SEND_SECONDS, Connection
from ps_server.dataplane.hello import HELLO_SECONDS, REFUSED, HelloCheck
from ps_server.dataplane.parked import Parking
from ps_server.dataplane.records import FrameReader
from ps_server.dataplane.refusals import RateLimitedWarnings, Refusals
from ps_server.service.rank_tokens import RankTokens
from ps_server.threads import OwnedThreads

__all__ = ["HELLO_SECONDS", "POLL_SECONDS", "REFUSED", "SEND_SECONDS", "WARN_SECONDS", "DataPlane"]
__all__ += ["RateLimitedWarnings", "wire_slots"]

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25
"""How often a waiting PushPull checks that its call is still active."""

WARN_SECONDS = 10.0
"""At most one WARNING line per this many seconds about refused connections (the rest are counted
and their number said in the next line)."""


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
        self._refusals = Refusals(refused or (lambda: None), RateLimitedWarnings(log, WARN_SECONDS))
        self._hellos = HelloCheck(token, admin_token, rank_tokens, self._member, self._refusals)
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
        self._by_rank: dict[int, Connection] = {}
        self._open: set[socket.socket] = set()
        self._closed = False
        self._parking = Parking(
            self._cond, lambda: self._by_rank.values(), frame_timeout, max_parked_bytes, self._refusals
        )
        self._calls = CallServer(call, max_call_bytes)
        self._reader = FrameReader(
            shard_index,
            plan_of,
            self._parking,
            self._calls,
            self._member,
            self._admit,
            self._refusals,
            landed or (lambda: None),
            self._counted,
        )
        self._threads.start(self._accept, f"shard{shard_index}-data-listener")
        self._threads.start(
            functools.partial(self._parking.expire, lambda: self._closed, self._lost), f"shard{shard_index}-data-expiry"
        )

    @property
    def frame_timeout(self) -> float:
        """Seconds a parked frame may wait without a partition landing or a call looking at it."""
        return self._parking.frame_timeout

    @property
    def expired(self) -> int:
        """Parked frames released after :attr:`frame_timeout` (complete or partial)."""
        return self._parking.expired

    @property
    def parked_bytes(self) -> int:
        """Bytes of push frames parked now (complete and being read) over all connections."""
        return self._parking.parked_bytes

    @property
    def calls(self) -> int:
        """Calls answered on the connections (refusals included)."""
        return self._calls.calls

    @property
    def max_call_bytes(self) -> int:
        """Longest call request accepted (the gRPC server's message limit)."""
        return self._calls.max_call_bytes

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
                        self._refusals.refuse("data connection refused: %d open (the most)", self.max_connections)
                    continue
                self._open.add(sock)
            self._threads.start(functools.partial(self._serve, sock), f"shard{self.shard_index}-data")

    def _serve(self, sock: socket.socket) -> None:
        conn: Connection | None = None
        try:
            dataconn.tune(sock)
            conn = self._hello(sock)
            if conn is None:
                return
            sock.settimeout(None)  # a connection waits for frames as long as the worker trains
            self._reader.read(conn)
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
                    conn.frames.clear()
                self._cond.notify_all()
            sock.close()

    def _hello(self, sock: socket.socket) -> Connection | None:
        """Read ``sock``'s hello and register the connection it opens, replacing the rank's old one
        (only the rank's current session may); None: refused."""
        conn = self._hellos.read(sock)
        if conn is None:
            return None
        rank = conn.rank
        with self._cond:
            taken = rank in self._by_rank
        if taken and not self._admit(rank, conn.incarnation, conn.session):  # only the rank's session replaces it
            self._refusals.refuse("data connection of rank %d closed: not the rank's current session", rank)
            return None
        with self._cond:
            old = self._by_rank.get(rank)
            self._by_rank[rank] = conn
            self._cond.notify_all()
        if old is not None:
            self._lost(old, "a newer data connection of the same rank replaced it")
        sock.sendall(dataconn.REPLY.pack(dataconn.MAGIC, 0))
        return conn

    def _lost(self, conn: Connection, why: str) -> None:
        """Close ``conn`` for ``why`` (its thread ends; waiters on it get DataPathError)."""
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
                parts = self._parking.take(conn, sequence)
                if parts is not None:
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
            return self._parking.peek(conn, sequence)

    def loopback(self, rank: int) -> bool:
        """Whether rank's connection comes from a loopback address (False: none, or another host)."""
        with self._cond:
            conn = self._by_rank.get(rank)
            return conn is not None and conn.loopback

    def _connection(self, rank: int, incarnation: int, sequence: int) -> Connection:
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
            sent = conn.send(buffers, time.monotonic() + (SEND_SECONDS if timeout is None else max(0.0, timeout)))
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
