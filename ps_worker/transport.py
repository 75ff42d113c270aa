"""The worker's gRPC transport: one channel per shard, calls fanned out to every shard, retries.

:class:`Transport` owns the channels, the stubs and the multi-callables of the data RPCs (which
take and give ``bytes``: partitions travel as hand-built frames, :mod:`ps_worker.encoding`), and a
thread pool that runs one call per shard in parallel. It knows nothing of plans, clocks or modes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from ps_common import frames
from ps_common.channels import channel
from ps_common.wire import message_size
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_worker.retry import retry_call

if TYPE_CHECKING:
    from ps_worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")


SERVICE = "/ps.v1.ParameterService/"

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
        retry_deadline: seconds to keep retrying transient failures (:func:`ps_worker.retry.retry_call`).
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
        retry_deadline: float = 30.0,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.servers = list(servers)
        self.timeout = timeout
        self.retry_deadline = retry_deadline
        self.metrics = metrics
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        limit = partition_bytes + frames.MESSAGE_OVERHEAD_BYTES
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

    def each_shard(self, fn: Callable[[int], T]) -> list[T]:
        """Run ``fn(shard_index)`` for every shard in parallel; once all are done, re-raise the first
        error in shard order."""
        if self.num_shards == 1:  # no hand-off to a pool thread (a third of a small step's time)
            return [fn(0)]
        pending = [self._pool.submit(fn, k) for k in range(self.num_shards)]
        futures.wait(pending)
        return [f.result() for f in pending]

    def call(self, fn: Callable[[], T], what: str) -> T:
        """``fn`` with retries of transient failures for up to ``retry_deadline`` seconds."""
        return retry_call(fn, self.retry_deadline, what)

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
        for ch in self.channels:
            ch.close()
        self._pool.shutdown(wait=True)
