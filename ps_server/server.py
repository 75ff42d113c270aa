"""Server factory: one shard's gRPC server with health, reflection and token checks."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from ps_common import tracing
from ps_common.codec import DTYPES
from ps_common.metrics_endpoint import MetricsEndpoint, serve_metrics
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_server.checkpoint import dirlock
from ps_server.checkpoint.checkpointer import Checkpointer
from ps_server.checkpoint.files import CheckpointStore
from ps_server.config import ServerConfig
from ps_server.dataplane.connections import DataPlane
from ps_server.metrics import ServerMetrics
from ps_server.service.admin import AdminServicer
from ps_server.service.auth import TokenCheck
from ps_server.service.call_metrics import PUSH_PULL, PUSH_PULL_ONCE, CallMetrics
from ps_server.service.chain import Chain
from ps_server.service.decoding import Decoding, lenient
from ps_server.service.parameters import ParameterServicer, parameter_service_handler
from ps_server.service.streams import PUBLIC, WATCH, StreamLimit, StreamLimits
from ps_server.service.tracing import traced
from ps_server.service.waiting_calls import Alarms, WaitingCalls
from ps_server.shard.counters import ShardCounters
from ps_server.shard.shard import Shard
from ps_server.shard.views import StatusView
from ps_server.tables.metrics import TableCollector
from ps_server.tables.reads import READ_THREADS, TableReads, lower_priority
from ps_server.threads import OwnedThreads

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    ps_pb2.DESCRIPTOR.services_by_name["ParameterService"].full_name,
    ps_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
)

JOIN_TIMEOUT = 5.0
"""Seconds :meth:`ShardServer.stop` waits, after the gRPC grace period, for its threads to end."""


class ShardServer:
    """A running shard: gRPC server, state, and the lease reaper.

    Use :func:`start_server` (which calls :meth:`start`); call :meth:`stop` to shut down. The
    threads it owns (``threads``: the lease reaper ``lease-reaper-{k}``, which also sweeps tables'
    expired rows each tick (``TableStore.expire``, bounded work per tick), the server's pool
    ``shard{k}_*``, the streams' pool ``shard{k}-streams_*``, the waiting calls' pool
    ``shard{k}-waits_*``) start in :meth:`start` or with the gRPC server and are joined by
    :meth:`stop`; the checkpointer joins its own writer.
    """

    def __init__(
        self,
        config: ServerConfig,
        server: grpc.Server,
        port: int,
        shard: Shard,
        health_servicer: health.HealthServicer,
        counters: ShardCounters,
        stopping: threading.Event,
        metrics: ServerMetrics | None = None,
        metrics_endpoint: MetricsEndpoint | None = None,
        checkpointer: Checkpointer | None = None,
        streams: StreamLimits | None = None,
        pool: futures.ThreadPoolExecutor | None = None,
        threads: OwnedThreads | None = None,
        data: DataPlane | None = None,
        waiting: WaitingCalls | None = None,
        reads: futures.ThreadPoolExecutor | None = None,
    ) -> None:
        self.config = config
        self._reads = reads
        """PullRows' read thread(s) (``ps_server.tables.reads``)."""
        self.waiting = waiting
        """The calls that may wait: their cap, pool, and how many are open (``.open``)."""
        self.data = data
        """The data connections (None: ``--data-port -1`` or TLS)."""
        self.server = server
        self.port = port
        self.shard = shard
        self.health = health_servicer
        self.counters = counters
        self._stopping = stopping
        self.metrics = metrics
        self.metrics_endpoint = metrics_endpoint
        self.checkpointer = checkpointer
        self.streams = streams
        """The long-lived streams' limits (``.limits[group].open``) and pool."""
        self._pool = pool
        self.threads = threads or OwnedThreads()
        """The threads this server started (joined by :meth:`stop`)."""
        self._started = False
        self.checkpoint_lock: dirlock.ShardLock | None = None
        """The shard's lock on its checkpoint directory (``ps_server.checkpoint.dirlock``), released by :meth:`stop`."""

    def start(self) -> None:
        """Start the lease reaper ``lease-reaper-{k}`` (the gRPC server is started by
        :func:`start_server`); idempotent, and a no-op once stopping."""
        if self._started or self._stopping.is_set():
            return
        self._started = True
        self.threads.start(self._reap, f"lease-reaper-{self.config.shard_index}")

    @property
    def address(self) -> str:
        """``host:port`` that clients dial."""
        host = self.config.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._stopping.is_set()

    @property
    def metrics_url(self) -> str | None:
        """``http://host:port/metrics``, or None when metrics are not served over HTTP."""
        return self.metrics_endpoint.url if self.metrics_endpoint else None

    def _reap(self) -> None:
        interval = max(0.05, min(1.0, self.config.lease_timeout / 4))
        while not self._stopping.wait(interval):
            self.shard.expire_leases()
            self.shard.report_missing()
            self.shard.expire_table_rows()  # tables with expiry: a bounded sweep per tick

    def stop(self, grace: float = 2.0) -> None:
        """Mark NOT_SERVING, wake waiters with UNAVAILABLE, and stop within ``grace`` seconds; then
        join this server's threads (within ``JOIN_TIMEOUT`` more seconds; any still alive is logged)."""
        self._stopping.set()
        self.health.enter_graceful_shutdown()
        self.shard.close()
        if self.data is not None:
            self.data.close()
        if self.checkpointer is not None:
            self.checkpointer.close(final=True)
        self.server.stop(grace).wait(grace + 1)
        if self.checkpoint_lock is not None:  # after the final checkpoint
            self.checkpoint_lock.release()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        if self.streams is not None:
            self.streams.pool.shutdown(wait=False)
        if self._reads is not None:
            self._reads.shutdown(wait=False, cancel_futures=True)
        if self.waiting is not None:
            self.waiting.pool.shutdown(wait=False)
            if self.waiting.alarms is not None:
                self.waiting.alarms.close()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
        self.threads.join(JOIN_TIMEOUT, f"shard {self.config.shard_index}")
        log.info("shard %d stopped", self.config.shard_index)

    def wait(self) -> None:
        self.server.wait_for_termination()


def credentials(config: ServerConfig) -> grpc.ServerCredentials:
    """TLS credentials of ``config`` (mutual TLS when ``tls_client_ca`` is set)."""
    with open(config.tls_key, "rb") as key, open(config.tls_cert, "rb") as cert:
        pair = (key.read(), cert.read())
    client_ca = None
    if config.tls_client_ca:
        with open(config.tls_client_ca, "rb") as ca:
            client_ca = ca.read()
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


def start_server(config: ServerConfig, shard: Shard | None = None) -> ShardServer:
    """Build, bind and start a shard's server.

    Args:
        config: validated settings; ``port=0`` picks a free port.
        shard: state to serve (a fresh :class:`Shard` by default).

    Returns:
        The running server; ``.port`` is the bound port, ``.metrics`` its Prometheus metrics (in a
        registry of its own), ``.metrics_url`` where they are served (``config.metrics_port >= 0``).

    Raises:
        RuntimeError: the address or the metrics port could not be bound.
        CheckpointError: ``checkpoint_dir`` is not writable, or holds checkpoints none of which loads.
        ValueError: ``shard`` is given with periodic checkpoints (``checkpoint_dir`` and
            ``checkpoint_every``): a shard's snapshot hook is fixed when it is built.
    """
    if shard is not None and config.checkpoint_dir and config.checkpoint_every:
        raise ValueError(
            "start_server cannot checkpoint a given shard every N versions (its on_snapshot is set when it is "
            "built); pass shard=None, or checkpoint_every=0."
        )
    # In order: the counters, metrics and the checkpointer (nothing started), the shard that offers
    # it its snapshots, the resume, then the threads once the port is bound.
    served: Shard | None = shard
    counters = shard.counters if shard is not None else ShardCounters()  # one set: GetStatus and Prometheus
    metrics = ServerMetrics(CollectorRegistry(), lambda: _status(served), counters)
    checkpointer, lock = None, None
    if config.checkpoint_dir:
        store = CheckpointStore(config.checkpoint_dir, config.shard_index, keep=config.checkpoint_keep)
        store.ensure_writable()
        lock = dirlock.hold(config.checkpoint_dir, config.shard_index)  # held until stop: ps-admin reshard sees it
        checkpointer = Checkpointer(store, metrics)
    if shard is None:
        shard = Shard(
            config.shard_index,
            config.num_shards,
            config.mode_settings(),
            config.lease_timeout,
            join_timeout=config.join_timeout,
            limits=config.limits,
            checkpoint_every=config.checkpoint_every if checkpointer is not None else 0,
            on_snapshot=checkpointer.offer if checkpointer is not None else None,
            counters=counters,
            record_key=config.admin_token,
            cluster_id=config.cluster_id,
        )
    served = shard
    shard.tables.max_rows = config.max_table_rows
    shard.tables.max_bytes = config.max_table_bytes
    metrics.registry.register(TableCollector(shard.table_metrics))
    shard.durable_acks = config.durable_acks and checkpointer is not None
    shard.stream_rounds = config.stream_rounds
    if checkpointer is not None:
        checkpointer.attach(shard)
        try:
            checkpointer.resume()
        except BaseException:
            if lock is not None:
                lock.release()
            raise
    threads = OwnedThreads()
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", int(config.reuse_port)),
    ]
    # Long-lived streams run in a pool of their own, capped per group (ps_server.service.streams): however
    # many a client opens, the data plane keeps all of its threads and its share of concurrent RPCs.
    streams = StreamLimits(
        {
            WATCH: StreamLimit(
                config.max_watch_streams, "Admin/WatchStatus streams (ps-admin top)", "--max-watch-streams"
            ),
            PUBLIC: StreamLimit(
                config.max_public_streams, "Health/Watch and reflection streams", "--max-public-streams"
            ),
        },
        threads.pool(config.stream_threads, f"shard{config.shard_index}-streams"),
    )
    # The calls that may wait (a round, a table version, a client stream) run in a pool of their own,
    # capped (ps_server.service.waiting_calls): Health, Admin and Join keep the server's pool whatever they do.
    waiting = WaitingCalls(
        config.waiting_calls,
        threads.pool(config.wait_threads, f"shard{config.shard_index}-waits"),
        config.shard_index,
        rank_share=config.rank_share,
        first_message_seconds=config.first_message_seconds,
        alarms=Alarms(lambda run: threads.start(run, f"shard{config.shard_index}-first-messages")),
    )
    pool = threads.pool(config.threads, f"shard{config.shard_index}")
    recorder = CallMetrics(metrics)
    tokens = TokenCheck(config.token, config.admin_token, lambda code: counters.add(rejected=1), config.rank_tokens)
    # One interceptor, its order fixed (ps_server.service.chain): metrics, the token check, the stream
    # caps, the waiting calls, tracing (only while on), decoding (innermost: see its docstring).
    stages = [streams.wrap, waiting.wrap, *([traced] if tracing.enabled() else [])]
    stages.append(Decoding(on_refused=lambda: counters.add(rejected=1)).wrap)
    server = grpc.server(
        pool,
        interceptors=[Chain(recorder.wrap, stages, admit=tokens.admit, deserializer=lenient)],
        options=options,
        maximum_concurrent_rpcs=config.threads * 4 + config.stream_threads + config.wait_threads,
    )
    # PullRows' reads on a thread of the lowest CPU priority: they take what the dense path leaves
    reads = threads.pool(READ_THREADS, f"shard{config.shard_index}-table-reads", initializer=lower_priority)
    servicer = ParameterServicer(
        shard, counters, rank_tokens=config.rank_tokens, table_reads=TableReads(reads, config.shard_index)
    )
    server.add_generic_rpc_handlers((parameter_service_handler(servicer),))
    stopping = threading.Event()
    ps_pb2_grpc.add_AdminServicer_to_server(AdminServicer(shard, counters, stopping, checkpointer), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    host = config.host
    bind = f"[{host}]:{config.port}" if ":" in host else f"{host}:{config.port}"
    try:
        port = server.add_secure_port(bind, credentials(config)) if config.tls_cert else server.add_insecure_port(bind)
    except RuntimeError as exc:
        raise RuntimeError(f"Could not bind {bind}: {exc}; is the port in use?") from exc
    if port == 0:
        raise RuntimeError(f"Could not bind {bind}; is the port in use?")
    endpoint = None
    if config.metrics_port >= 0:
        try:
            endpoint = serve_metrics(metrics.registry, host, config.metrics_port)
        except RuntimeError:
            server.stop(None)
            raise
    data = None
    if config.data_port >= 0 and not config.tls_cert:  # with TLS the bytes stay on the TLS stream
        try:
            data = DataPlane(
                host,
                config.data_port,
                config.shard_index,
                lambda: served.plan if served is not None else None,
                token=config.token,
                admin_token=config.admin_token,
                rank_tokens=config.rank_tokens,
                max_connections=config.threads,
                threads=threads,
                counted=lambda received, sent: counters.transferred(PUSH_PULL, received, sent),
                call=recorder.unary(servicer.push_pull_once_chunks, PUSH_PULL_ONCE),
                max_call_bytes=config.max_message_bytes,
                landed=shard.wake,
                member=shard.check_live,
                frame_timeout=config.frame_timeout,
                max_parked_bytes=parked_bound(shard, config.max_parked_bytes),
                refused=lambda: counters.add(rejected=1),
                admit=shard.session_is,
            )
        except RuntimeError:
            server.stop(None)
            if endpoint is not None:
                endpoint.close()
            raise
        servicer.data = data
    if checkpointer is not None:
        checkpointer.start()
    server.start()
    for name in ("", *SERVICE_NAMES):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    for warning in config.warnings():
        log.warning("shard %d: %s", config.shard_index, warning)
    log.info(
        "shard %d/%d serving %s on %s:%d for %d workers%s",
        config.shard_index,
        config.num_shards,
        config.mode,
        host,
        port,
        config.num_workers,
        f"; data connections on port {data.port}" if data is not None else "",
    )
    running = ShardServer(
        config,
        server,
        port,
        shard,
        health_servicer,
        counters,
        stopping,
        metrics,
        endpoint,
        checkpointer,
        streams,
        pool=pool,
        threads=threads,
        data=data,
        waiting=waiting,
        reads=reads,
    )
    running.checkpoint_lock = lock
    running.start()
    return running


def parked_bound(shard: Shard, configured: int) -> Callable[[], int]:
    """The data plane's bound on parked push-frame bytes: ``configured`` (--max-parked-bytes), or
    two frames of the shard's partitions (in their parameters' dtypes, the widest a frame may
    carry) per rank the shard lists (0 before Init: no frame is read then)."""
    cache: dict[int, int] = {}

    def bound() -> int:
        if configured:
            return configured
        plan = shard.plan
        if plan is None:
            return 0
        frame = cache.get(id(plan))
        if frame is None:
            owned = plan.owned_by(shard.shard_index)
            frame = sum(p.length * DTYPES[plan.dtypes[p.key]].itemsize for p in owned)
            cache.clear()
            cache[id(plan)] = frame
        return 2 * len(shard.members) * frame

    return bound


def _status(shard: Shard | None) -> StatusView:
    """``shard.status()`` for the metrics' collector, which is built before the shard."""
    if shard is None:
        raise RuntimeError("the shard's status was read before the shard was built")
    return shard.status()
