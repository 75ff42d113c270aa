"""The worker's gRPC transport: one channel per shard, calls fanned out to every shard, retries.

:class:`Transport` owns the channels, the stubs and the multi-callables of the data RPCs (which
take and give ``bytes``: partitions travel as hand-built frames, :mod:`ps_worker.transport.encoding`), and a
thread pool that runs one call per shard in parallel. It knows nothing of plans, clocks or modes.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from ps_common import frames, tracing
from ps_common.channels import channel
from ps_common.dataconn import DATA_PATHS
from ps_common.wire import message_size
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_worker.transport.data_link import DataConnection, DataLinkError, host_of
from ps_worker.transport.retry import CallPolicy

if TYPE_CHECKING:
    from ps_worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")


SERVICE = "/ps.v1.ParameterService/"

DATA_RETRY_SECONDS = 30.0
"""After a data connection failed, PushPull goes on gRPC for this long before connecting again."""

LEAVE_SECONDS = 5.0
"""Deadline of the best-effort Leave at close, and of joining the pool's threads."""


class Transport:
    """Channels and calls to every shard.

    Args:
        servers: ``host:port`` of every shard, in shard-index order.
        partition_bytes: largest partition payload in bytes (the message size limit adds
            :data:`ps_common.frames.MESSAGE_OVERHEAD_BYTES`).
        token: bearer token for ParameterService, or None.
        timeout: per-RPC deadline, seconds.
        retry_deadline: seconds to keep retrying transient failures (:attr:`policy`).
        tls_ca, tls_cert, tls_key: PEM files (see :func:`ps_common.channels.channel`).
        metrics: where sent bytes are counted, or None.

    Raises:
        ValueError: inconsistent TLS files. OSError: a TLS file cannot be read.
    """

    def __init__(
        self,
        servers: Sequence[str],
        partition_bytes: int,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        retry_deadline: float = 120.0,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        metrics: WorkerMetrics | None = None,
        data_path: str = "tcp",
    ) -> None:
        if data_path not in DATA_PATHS:
            raise ValueError(f"data_path must be one of {', '.join(DATA_PATHS)}, got {data_path!r}.")
        self.servers = list(servers)
        self._token = token or ""
        self.data_ports = [0] * len(self.servers)
        """JoinResponse.data_port of each shard (0: none offered)."""
        self._data: list[DataConnection | None] = [None] * len(self.servers)
        self._never = [data_path == "grpc" or bool(tls_ca or tls_cert)] * len(self.servers)
        """Per shard: no data connection ever (``grpc``, TLS, a target with no host)."""
        self._down = [False] * len(self.servers)
        """Per shard: connecting or the connection failed; tried again at ``_retry_at`` or after the
        next Join, whichever comes first."""
        self._retry_at = [0.0] * len(self.servers)
        self._data_lock = threading.Lock()  # the heartbeat thread offers ports while steps use them
        self._sequence = itertools.count(1)
        self.timeout = timeout
        self.retry_deadline = retry_deadline
        self.policy = CallPolicy(retry_deadline)
        """How every call to the shards is retried, waits and recovers (:mod:`ps_worker.transport.retry`)."""
        self.metrics = metrics
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.max_message_bytes = limit = partition_bytes + frames.MESSAGE_OVERHEAD_BYTES
        """Longest message either way (gRPC's limits on the channels; a call's answer on a data connection)."""
        options = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # a restarted shard is back in seconds: reconnect within 1 s, not gRPC's default 120 s backoff
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self.channels = [channel(addr, options, tls_ca, tls_cert, tls_key) for addr in self.servers]
        self.stubs = [ps_pb2_grpc.ParameterServiceStub(ch) for ch in self.channels]
        # the data RPCs with pass-through (de)serializers: partitions travel as hand-built frames
        self.init_calls = [
            ch.stream_unary(SERVICE + "Init", response_deserializer=ps_pb2.InitResponse.FromString)
            for ch in self.channels
        ]
        self.push_calls = [
            ch.stream_unary(SERVICE + "Push", response_deserializer=ps_pb2.PushResponse.FromString)
            for ch in self.channels
        ]
        self.pull_calls = [
            ch.unary_stream(SERVICE + "Pull", request_serializer=ps_pb2.PullRequest.SerializeToString)
            for ch in self.channels
        ]
        self.push_pull_calls = [ch.stream_stream(SERVICE + "PushPull") for ch in self.channels]
        # one message each way (a small model): a unary call, cheaper than a stream on both sides
        self.push_pull_once = [ch.unary_unary(SERVICE + "PushPullOnce") for ch in self.channels]
        self.exchange_calls = [ch.stream_stream(SERVICE + "Exchange") for ch in self.channels]
        self._pool = futures.ThreadPoolExecutor(max_workers=len(self.servers), thread_name_prefix="ps-client")
        self.closed = False

    @property
    def num_shards(self) -> int:
        return len(self.servers)

    # ------------------------------------------------------------------ data connections
    def offer_data_port(self, k: int, port: int, joined: bool = True) -> None:
        """Shard ``k`` answered a Join (``joined``) or a Heartbeat with its data ``port`` (0: none).
        A new port (a restarted shard) replaces the old connection and is tried at the next push,
        as is any port after a Join; otherwise a connection that failed waits out
        :data:`DATA_RETRY_SECONDS`."""
        with self._data_lock:
            changed = port != self.data_ports[k]
            if changed:
                self.data_ports[k] = port
                self._drop_locked(k)
            if changed or joined:
                self._down[k] = False

    def data_connection(self, k: int, rank: int, incarnation: int, session: int = 0) -> DataConnection | None:
        """The open data connection to shard ``k`` for this rank and incarnation (a new one says
        ``session``, the rank's ``JoinResponse.session`` there, in its hello), connecting on
        first use; None when the shard offers none, ``data_path="grpc"``, TLS, or connecting failed
        (then gRPC carries the partitions until the shard offers another port)."""
        with self._data_lock:
            if self._down[k] and time.monotonic() >= self._retry_at[k]:
                self._down[k] = False
            port = self.data_ports[k]
            if self._never[k] or self._down[k] or not port:
                return None
            conn = self._data[k]
            if (
                conn is not None
                and not conn.closed
                and (conn.rank, conn.incarnation, conn.session)
                == (
                    rank,
                    incarnation,
                    session,
                )
            ):
                return conn
            self._drop_locked(k)
            host = host_of(self.servers[k])
            if host is None:
                self._never[k] = True
                return None
        try:  # outside the lock: a heartbeat must not wait for a connect
            conn = DataConnection(host, port, rank, incarnation, self._token, self.timeout, session)
        except DataLinkError as exc:
            log.warning("%s; PushPull to shard %s goes on gRPC alone", exc.details(), self.servers[k])
            self.data_failed(k, "")
            return None
        with self._data_lock:
            if self.data_ports[k] != port or self._data[k] is not None:  # a heartbeat offered another port
                conn.close()
                return None
            self._data[k] = conn
        return conn

    def data_failed(self, k: int, why: str) -> None:
        """Close shard ``k``'s data connection after a failure (``why``; "" when connecting failed,
        already logged); gRPC alone carries PushPull for :data:`DATA_RETRY_SECONDS` or until the
        next Join (so the retry of the failed call goes on the gRPC stream)."""
        if why:
            log.warning(
                "PushPull to shard %s on its data connection failed (%s); on gRPC for now", self.servers[k], why
            )
        with self._data_lock:
            self._drop_locked(k)
            if not self._never[k] and not self._down[k]:
                self._down[k] = True
                self._retry_at[k] = time.monotonic() + DATA_RETRY_SECONDS

    @property
    def data_connected(self) -> list[bool]:
        """Per shard: whether a data connection is open now."""
        return [c is not None and not c.closed for c in self._data]

    def drop_data(self, k: int) -> None:
        """Close shard ``k``'s data connection without a failure (an abandoned push's frame goes
        with it); the next push connects again."""
        self._drop(k)

    def next_sequence(self) -> int:
        """A frame number never used before by this transport."""
        return next(self._sequence)

    def _drop(self, k: int) -> None:
        with self._data_lock:
            self._drop_locked(k)

    def _drop_locked(self, k: int) -> None:
        conn, self._data[k] = self._data[k], None
        if conn is not None:
            conn.close()

    def each_shard(self, fn: Callable[[int], T]) -> list[T]:
        """Run ``fn(shard_index)`` for every shard in parallel; once all are done, re-raise the first
        error in shard order."""
        if self.num_shards == 1:  # no hand-off to a pool thread (a third of a small step's time)
            return [fn(0)]
        pending = [tracing.run_in_context(self._pool, fn, k) for k in range(self.num_shards)]
        futures.wait(pending)
        return [f.result() for f in pending]

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """A data call's metadata: :attr:`metadata`, and the current span's ``traceparent`` when
        tracing is on (:mod:`ps_common.tracing`)."""
        return self.metadata + tracing.headers()

    def call(self, fn: Callable[[], T], what: str) -> T:
        """``fn`` with retries of transient failures for up to ``retry_deadline`` seconds (:attr:`policy`)."""
        return self.policy.call(fn, what)

    def sent(self, msg: Any) -> Any:
        """Count ``msg`` (a protobuf message or a frame) in ``ps_worker_sent_bytes_total``; returns it."""
        if self.metrics is not None:
            self.metrics.sent_bytes.inc(len(msg) if isinstance(msg, bytes) else message_size(msg))
        return msg

    def received(self, nbytes: int) -> None:
        """Count ``nbytes`` of a received message in ``ps_worker_received_bytes_total``."""
        if self.metrics is not None:
            self.metrics.received_bytes.inc(nbytes)

    def close(
        self,
        leave: Callable[[int], ps_pb2.LeaveRequest] | None = None,
        told: Callable[[int, ps_pb2.LeaveResponse], None] | None = None,
    ) -> None:
        """Send ``leave(k)`` to every shard ``k`` in order (best effort; each answer to ``told``),
        close the channels (cancelling calls still in flight, such as an interrupted step's round
        wait) and join the pool's threads. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if leave is not None:
            for k, stub in enumerate(self.stubs):
                try:
                    answer = stub.Leave(leave(k), timeout=LEAVE_SECONDS, metadata=self.metadata)
                except grpc.RpcError as exc:
                    log.info("leave %s: %s", self.servers[k], exc.code())
                else:
                    if told is not None:
                        told(k, answer)
        for k in range(self.num_shards):
            self._drop(k)
        for ch in self.channels:
            ch.close()
        self._pool.shutdown(wait=True)
