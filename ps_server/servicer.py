"""gRPC servicers of a shard: decode, call :class:`~ps_server.shard.Shard`, encode.

Domain errors become status codes through their class's ``code`` (``ps_common.errors``, one table for both sides).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from ps_common import errors, frames
from ps_common.modes import ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_common.plan import Plan
from ps_common.text import shown
from ps_common.wire import (
    MODE_TO_NAME,
    NAME_TO_MODE,
    SpecList,
    dtype_name,
    hyperparameters_from_proto,
    optimizer_from_proto,
    optimizer_to_proto,
)
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_server.checkpointer import Checkpointer
from ps_server.core.partitions import Intake
from ps_server.export import export_messages
from ps_server.interceptors import note_push
from ps_server.request_streams import Request, read_request
from ps_server.shard import PushResult, Shard, StatusView, WorkerState

log = logging.getLogger(__name__)


WORKER_STATES = {
    WorkerState.PENDING: ps_pb2.WORKER_STATE_PENDING,
    WorkerState.LIVE: ps_pb2.WORKER_STATE_LIVE,
    WorkerState.EVICTED: ps_pb2.WORKER_STATE_EVICTED,
    WorkerState.LEFT: ps_pb2.WORKER_STATE_LEFT,
}

F = TypeVar("F", bound=Callable[..., Any])


def status_code(exc: errors.PSError) -> grpc.StatusCode:
    """The status code of a domain error (its class's ``code``, ``ps_common.errors``)."""
    return grpc.StatusCode[exc.code]


class Counters:
    """Bytes and refusals of one shard, shared by its servicers (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.received_bytes = 0
        self.sent_bytes = 0
        self.rejected = 0

    def add(self, received: int = 0, sent: int = 0, rejected: int = 0) -> None:
        with self._lock:
            self.received_bytes += received
            self.sent_bytes += sent
            self.rejected += rejected


def _refuse(servicer: Any, name: str, exc: errors.PSError, context: grpc.ServicerContext) -> None:
    servicer.counters.add(rejected=1)
    code = status_code(exc)
    level = logging.INFO if code == grpc.StatusCode.DEADLINE_EXCEEDED else logging.WARNING
    message = shown(str(exc))  # client text escaped and cut short: one log line, a detail gRPC can send
    log.log(level, "%s refused (%s): %s", name, code.name, message)
    context.set_trailing_metadata(((errors.REASON_KEY, str(exc.reason)),))
    context.abort(code, message)


def _maps_errors(method: F) -> F:
    """Unary or client-streaming method: a domain error becomes ``context.abort`` with its code."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except errors.PSError as exc:
            _refuse(self, method.__name__, exc, context)

    return wrapper  # type: ignore[return-value]


def _maps_stream_errors(method: F) -> F:
    """Server-streaming method: like :func:`_maps_errors`, for errors raised while iterating."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from method(self, request, context)
        except errors.PSError as exc:
            _refuse(self, method.__name__, exc, context)

    return wrapper  # type: ignore[return-value]


def _wire_dtype(value: int) -> str:
    """The wire dtype name of a request's ``wire_dtype`` ("" when unset).

    Raises:
        InvalidRequestError: an unknown value.
    """
    return "" if value == ps_pb2.DTYPE_UNSPECIFIED else dtype_name(value)


def _deadline(context: grpc.ServicerContext) -> float | None:
    """Seconds a wait may take so the shard's answer (which names what the wait is for) reaches the
    client before its own deadline: a tenth of the time left, 0.1 s to 1 s, is kept for the way back
    (a loaded machine delays both the wake-up and the status)."""
    remaining = context.time_remaining()
    if remaining is None or remaining > 1e9:
        return None
    return max(0.0, remaining - min(1.0, max(0.1, remaining / 10)))


def cluster_config(settings: ModeSettings, lease_timeout: float, learning_rate: float) -> ps_pb2.ClusterConfig:
    """The ClusterConfig message of the settings in force."""
    return ps_pb2.ClusterConfig(
        mode=NAME_TO_MODE[settings.mode],
        num_workers=settings.num_workers,
        lease_timeout_seconds=lease_timeout,
        learning_rate=learning_rate,
        sync_quorum=settings.sync_quorum,
        round_timeout_seconds=settings.round_timeout,
        max_staleness=settings.max_staleness,
        staleness_lr=settings.staleness_lr,
        staleness=settings.staleness,
        moving_rate=settings.alpha,
        communication_period=settings.communication_period,
        easgd_sync=settings.easgd_sync,
    )


SMALL_FRAME = 64 * 1024
"""A first PushPull frame up to this size, or the only one, gets the push's answer prepended (a
copy); larger ones are sent after a message of their own with the answer."""


def _parse(cls: type[Any], raw: bytes) -> Any:
    """``cls.FromString(raw)``.

    Raises:
        InvalidRequestError: the bytes do not parse.
    """
    try:
        return cls.FromString(raw)
    except Exception:
        raise errors.InvalidRequestError(f"Malformed {cls.__name__}; send a valid ps.v1 message.") from None


def push_response(r: PushResult) -> ps_pb2.PushResponse:
    """The PushResponse of a push result."""
    return ps_pb2.PushResponse(
        version=r.version,
        duplicate=r.duplicate,
        staleness=r.staleness,
        dropped=r.dropped,
        mode=NAME_TO_MODE[r.mode],
        skipped=r.skipped,
    )


RAW_METHODS = frozenset({"Init", "Push", "Pull", "PushPull", "PushPullOnce", "Exchange"})
"""ParameterService methods whose partitions travel as hand-built frames (``ps_common.frames``):
their requests reach the servicer as ``bytes`` (Pull's small request the servicer parses itself)."""

RAW_RESPONSES = frozenset({"Pull", "PushPull", "PushPullOnce", "Exchange"})
"""Methods whose responses leave as ``bytes`` (Init's and Push's small answers are messages)."""


def parameter_service_handler(servicer: ParameterServicer) -> grpc.GenericRpcHandler:
    """The ``ps.v1.ParameterService`` handler of ``servicer``: generated (de)serializers for the
    small RPCs, pass-through ones where frames carry partitions (:data:`RAW_METHODS`)."""
    descriptor = ps_pb2.DESCRIPTOR.services_by_name["ParameterService"]
    handlers = {}
    for method in descriptor.methods:
        request_cls = getattr(ps_pb2, method.input_type.name)
        response_cls = getattr(ps_pb2, method.output_type.name)
        # parsed in the servicer, so a malformed request is INVALID_ARGUMENT, not gRPC's INTERNAL (the
        # others' undecodable bytes are refused by ps_server.decoding.DecodingInterceptor)
        deserializer = None if method.name in RAW_METHODS else request_cls.FromString
        serializer = None if method.name in RAW_RESPONSES else response_cls.SerializeToString
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(servicer, method.name), request_deserializer=deserializer, response_serializer=serializer
        )
    return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)


class ParameterServicer:
    """ps.v1.ParameterService over one :class:`Shard`. Not the generated servicer base: the data
    methods take and return ``bytes`` (see :func:`parameter_service_handler`, which registers it)."""

    def __init__(self, shard: Shard, counters: Counters) -> None:
        self.shard = shard
        self.counters = counters

    @_maps_errors
    def Join(self, request: ps_pb2.JoinRequest, context: grpc.ServicerContext) -> ps_pb2.JoinResponse:
        info = self.shard.join(request.rank, request.num_workers, request.incarnation)
        return ps_pb2.JoinResponse(
            shard_index=self.shard.shard_index,
            num_shards=self.shard.num_shards,
            config=cluster_config(self.shard.settings, self.shard.lease_timeout, self.shard.learning_rate()),
            initialized=info.initialized,
            version=info.version,
            plan_digest=info.plan_digest,
            clock=info.clock,
            optimizer=optimizer_to_proto(info.optimizer) if info.optimizer else None,
        )

    def _count(self, nbytes: int) -> None:
        self.counters.add(received=nbytes)

    def _read(self, request_iterator: Iterator[bytes], what: str, header_cls: type[Any], values: str) -> Request:
        """Read a Push, PushPull or Exchange stream: the header is checked against the shard's plan
        (initialized, same digest) before any partition is read, each partition as it arrives."""

        def open_(header: Any) -> Intake:
            return Intake(self.shard.check_plan(header.plan_digest), self.shard.shard_index, values)

        return read_request(request_iterator, what, header_cls, open_, what.startswith("PushPull"), self._count)

    @_maps_errors
    def Init(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> ps_pb2.InitResponse:
        opened: list[tuple[SpecList, Plan, OptimizerSpec]] = []

        def open_(header: ps_pb2.InitHeader) -> Intake:
            # rank, optimizer, then the plan: already initialized and the digest first, then its
            # bounds, all before it is built (Shard.init_plan)
            self.shard.check_rank(header.rank)
            optimizer = optimizer_from_proto(header.optimizer)
            specs = SpecList(header.plan.specs)
            plan = self.shard.init_plan(specs, header.plan.num_shards, header.plan.partition_bytes, header.plan.digest)
            opened.append((specs, plan, optimizer))
            return Intake(plan, self.shard.shard_index, "value")

        req = read_request(request_iterator, "Init", ps_pb2.InitHeader, open_, False, self._count)
        (specs, plan, optimizer), info = opened[0], req.header.plan
        applied, version, digest = self.shard.init(
            specs, info.num_shards, info.partition_bytes, info.digest, optimizer, req.parts, plan=plan
        )
        return ps_pb2.InitResponse(applied=applied, version=version, plan_digest=digest)

    @_maps_errors
    def Push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> ps_pb2.PushResponse:
        req = self._read(request_iterator, "Push", ps_pb2.PushHeader, "gradient")
        h = req.header
        r = self.shard.push(
            h.rank,
            h.incarnation,
            h.clock,
            h.version,
            h.plan_digest,
            req.parts,
            hyperparameters_from_proto(h),
            h.skip,
        )
        return push_response(r)

    @_maps_stream_errors
    def Pull(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        req = _parse(ps_pb2.PullRequest, request)
        version, out = self.shard.pull(
            req.rank,
            req.incarnation,
            req.min_version,
            req.plan_digest,
            _deadline(context),
            _wire_dtype(req.wire_dtype),
        )
        for frame in out:
            self.counters.add(sent=len(frame))
            yield frame

    def _push_pull(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext, single: bool) -> list[bytes]:
        """PushPull and PushPullOnce: push, then the messages of the version it lands in; the
        push's answer (field 3) leads the first message."""
        req = self._read(request_iterator, "PushPullOnce" if single else "PushPull", ps_pb2.PushHeader, "gradient")
        header, parts, first = req.header, req.parts, req.first
        result, version, out = self.shard.push_pull(
            header.rank,
            header.incarnation,
            header.clock,
            header.version,
            header.plan_digest,
            parts,
            _deadline(context),
            _wire_dtype(first.ints.get(3, 0)),
            single=single,
            hyper=hyperparameters_from_proto(header),
            skip=header.skip,
        )
        answer = push_response(result)
        note_push(answer)
        # A response of one message stays one; otherwise a large first frame is not copied to
        # prepend the answer: the answer goes alone, with the version
        lead = frames.bytes_field(3, answer.SerializeToString())
        if len(out) == 1 or len(out[0]) <= SMALL_FRAME:
            out = [lead + out[0], *out[1:]]
        else:
            out = [lead + frames.uint_field(1, version), *out]
        self.counters.add(sent=sum(len(frame) for frame in out))
        return out

    @_maps_stream_errors
    def PushPull(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from self._push_pull(request_iterator, context, single=False)

    @_maps_errors
    def PushPullOnce(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        (only,) = self._push_pull(iter([request]), context, single=True)
        return only

    @_maps_stream_errors
    def Exchange(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        req = self._read(request_iterator, "Exchange", ps_pb2.ExchangeHeader, "parameter")
        header, parts = req.header, req.parts
        version, out = self.shard.exchange(
            header.rank, header.incarnation, header.clock, header.plan_digest, parts, _deadline(context)
        )
        for frame in out:
            self.counters.add(sent=len(frame))
            yield frame

    @_maps_errors
    def Heartbeat(self, request: ps_pb2.HeartbeatRequest, context: grpc.ServicerContext) -> ps_pb2.HeartbeatResponse:
        version, state = self.shard.heartbeat(request.rank, request.incarnation)
        return ps_pb2.HeartbeatResponse(version=version, state=WORKER_STATES[state])

    @_maps_errors
    def Leave(self, request: ps_pb2.LeaveRequest, context: grpc.ServicerContext) -> ps_pb2.LeaveResponse:
        return ps_pb2.LeaveResponse(version=self.shard.leave(request.rank, request.incarnation))


def staleness_summary(counts: dict[int, int]) -> ps_pb2.StalenessSummary:
    """Exact percentiles of a histogram of staleness values."""
    total = sum(counts.values())
    if not total:
        return ps_pb2.StalenessSummary()
    ordered = sorted(counts.items())

    def quantile(q: float) -> float:
        rank, seen = q * (total - 1), 0
        for value, n in ordered:
            seen += n
            if seen > rank:
                return float(value)
        return float(ordered[-1][0])

    return ps_pb2.StalenessSummary(
        count=total, p50=quantile(0.5), p90=quantile(0.9), p99=quantile(0.99), max=ordered[-1][0]
    )


def _optimizer_in_force(view: StatusView) -> ps_pb2.OptimizerSpec | None:
    """The optimizer spec with the learning rate in force (``UpdateConfig`` changes it after Init):
    ``optimizer.kwargs.lr`` and ``config.learning_rate`` tell one truth."""
    if not view.optimizer:
        return None
    spec = optimizer_to_proto(view.optimizer)
    if "lr" in spec.kwargs and view.learning_rate:
        spec.kwargs["lr"] = view.learning_rate
    return spec


def status_to_proto(
    view: StatusView, counters: Counters, uptime: float, checkpointer: Checkpointer | None = None
) -> ps_pb2.ShardStatus:
    """ShardStatus message of a status snapshot (and of ``checkpointer``'s failed writes)."""
    failures = checkpointer.failures() if checkpointer is not None else None
    return ps_pb2.ShardStatus(
        shard_index=view.shard_index,
        num_shards=view.num_shards,
        config=cluster_config(view.settings, view.lease_timeout, view.learning_rate),
        initialized=view.initialized,
        version=view.version,
        plan_digest=view.plan_digest,
        num_partitions=view.num_partitions,
        num_elements=view.num_elements,
        parameter_bytes=view.parameter_bytes,
        optimizer=_optimizer_in_force(view),
        workers=[
            ps_pb2.WorkerStatus(
                rank=w.rank,
                incarnation=w.incarnation,
                clock=w.clock,
                state=WORKER_STATES[w.state],
                last_seen_seconds_ago=w.last_seen_seconds_ago,
                pushes=w.pushes,
            )
            for w in view.workers
        ],
        received_bytes=counters.received_bytes,
        sent_bytes=counters.sent_bytes,
        rejected_requests=counters.rejected,
        uptime_seconds=uptime,
        round_ranks=view.round_ranks,
        pending_mode=NAME_TO_MODE[view.pending_mode] if view.pending_mode else ps_pb2.MODE_UNSPECIFIED,
        max_clock_gap=view.max_clock_gap,
        rejected_pushes=view.rejected_pushes,
        staleness=staleness_summary(view.staleness),
        round_age_seconds=view.round_age_seconds,
        round_waiting_for=view.round_waiting_for,
        last_checkpoint_version=view.last_checkpoint_version,
        restored_from_version=view.restored_from_version,
        checkpoint_failures=failures.count if failures else 0,
        last_checkpoint_error=failures.last_error if failures else "",
    )


UPDATABLE = {
    "sync_quorum": "sync_quorum",
    "round_timeout_seconds": "round_timeout",
    "max_staleness": "max_staleness",
    "staleness_lr": "staleness_lr",
    "staleness": "staleness",
    "moving_rate": "moving_rate",
    "communication_period": "communication_period",
}
"""UpdateConfigRequest field -> ModeSettings attribute."""


class AdminServicer(ps_pb2_grpc.AdminServicer):
    """ps.v1.Admin over one :class:`Shard`."""

    def __init__(
        self,
        shard: Shard,
        counters: Counters,
        stopping: threading.Event | None = None,
        checkpointer: Checkpointer | None = None,
    ) -> None:
        self.shard = shard
        self.counters = counters
        self.checkpointer = checkpointer
        self.started = time.monotonic()
        self.stopping = stopping or threading.Event()

    def _status(self) -> ps_pb2.ShardStatus:
        return status_to_proto(self.shard.status(), self.counters, time.monotonic() - self.started, self.checkpointer)

    @_maps_errors
    def GetStatus(self, request: ps_pb2.GetStatusRequest, context: grpc.ServicerContext) -> ps_pb2.GetStatusResponse:
        return ps_pb2.GetStatusResponse(status=self._status())

    @_maps_stream_errors
    def WatchStatus(
        self, request: ps_pb2.WatchStatusRequest, context: grpc.ServicerContext
    ) -> Iterator[ps_pb2.WatchStatusResponse]:
        interval = request.interval_seconds or 1.0
        if not 0.1 <= interval <= 3600:
            raise errors.InvalidRequestError(f"interval_seconds must be in [0.1, 3600], got {interval}.")
        # woken when the client goes away (or the server stops it), so a closed `ps-admin top` frees
        # its --max-watch-streams slot at once, not after its interval
        ended = threading.Event()
        context.add_callback(ended.set)
        while context.is_active() and not self.stopping.is_set():
            yield ps_pb2.WatchStatusResponse(status=self._status())
            ended.wait(interval)

    @_maps_errors
    def UpdateConfig(
        self, request: ps_pb2.UpdateConfigRequest, context: grpc.ServicerContext
    ) -> ps_pb2.UpdateConfigResponse:
        changes = {attr: getattr(request, name) for name, attr in UPDATABLE.items() if request.HasField(name)}
        if request.mode != ps_pb2.MODE_UNSPECIFIED and request.mode not in MODE_TO_NAME:
            raise errors.InvalidRequestError(f"Unknown mode {request.mode}.")
        settings = self.shard.update_config(
            mode=MODE_TO_NAME.get(request.mode, ""),
            learning_rate=request.learning_rate if request.HasField("learning_rate") else None,
            **changes,
        )
        view = self.shard.status()
        return ps_pb2.UpdateConfigResponse(
            config=cluster_config(settings, self.shard.lease_timeout, view.learning_rate),
            pending_mode=NAME_TO_MODE[view.pending_mode] if view.pending_mode else ps_pb2.MODE_UNSPECIFIED,
        )

    @_maps_errors
    def Checkpoint(self, request: ps_pb2.CheckpointRequest, context: grpc.ServicerContext) -> ps_pb2.CheckpointResponse:
        if self.checkpointer is None:
            raise errors.PreconditionError("This shard has no --checkpoint-dir; restart it with one to checkpoint.")
        version, path, seconds = self.checkpointer.checkpoint_now()
        # absolute: a relative --checkpoint-dir means nothing to an operator in another directory
        return ps_pb2.CheckpointResponse(version=version, path=os.path.abspath(path), seconds=seconds)

    @_maps_errors
    def EvictWorker(
        self, request: ps_pb2.EvictWorkerRequest, context: grpc.ServicerContext
    ) -> ps_pb2.EvictWorkerResponse:
        previous, version = self.shard.evict(request.rank)
        return ps_pb2.EvictWorkerResponse(previous_state=WORKER_STATES[previous], version=version)

    @_maps_stream_errors
    def ExportParameters(
        self, request: ps_pb2.ExportParametersRequest, context: grpc.ServicerContext
    ) -> Iterator[ps_pb2.ExportParametersResponse]:
        for reply in export_messages(self.shard):  # ps_server.export
            self.counters.add(sent=reply.ByteSize())
            yield reply
