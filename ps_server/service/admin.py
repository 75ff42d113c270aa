"""The admin servicer of a shard (``ps.v1.Admin``): status snapshots, live configuration,
checkpoints on demand and operator evictions. GetStatus reads the shard's counters, the numbers
Prometheus exports (``ps_server.shard.counters``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import grpc

from ps_common import errors, modes
from ps_common.wire import MODE_TO_NAME, NAME_TO_MODE, optimizer_to_proto
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_server.checkpoint.checkpointer import Checkpointer
from ps_server.checkpoint.export import export_messages
from ps_server.service.rpc import WORKER_STATES, cluster_config, maps_errors, maps_stream_errors
from ps_server.shard.counters import ShardCounters
from ps_server.shard.shard import Shard
from ps_server.shard.views import StatusView


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
    view: StatusView, counters: ShardCounters, uptime: float, checkpointer: Checkpointer | None = None
) -> ps_pb2.ShardStatus:
    """ShardStatus message of a status snapshot, with the bytes and refused requests of
    ``counters`` (and ``checkpointer``'s failed writes)."""
    failures = checkpointer.failures() if checkpointer is not None else None
    counted = counters.view()
    received, sent = counted.data_bytes()
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
        received_bytes=received,
        sent_bytes=sent,
        rejected_requests=counted.rejected_requests,
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
        membership=view.membership,
        applied_changes=view.applied_changes,
        membership_authority=view.membership_authority,
        durable_acks=view.durable_acks,
        tables=view.tables,
        tables_version=view.tables_version,
    )


class AdminServicer(ps_pb2_grpc.AdminServicer):
    """ps.v1.Admin over one :class:`Shard`."""

    def __init__(
        self,
        shard: Shard,
        counters: ShardCounters,
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

    @maps_errors
    def GetStatus(self, request: ps_pb2.GetStatusRequest, context: grpc.ServicerContext) -> ps_pb2.GetStatusResponse:
        return ps_pb2.GetStatusResponse(status=self._status())

    @maps_stream_errors
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

    @maps_errors
    def UpdateConfig(
        self, request: ps_pb2.UpdateConfigRequest, context: grpc.ServicerContext
    ) -> ps_pb2.UpdateConfigResponse:
        changes = modes.changes_from_request(request)
        if request.mode != ps_pb2.MODE_UNSPECIFIED and request.mode not in MODE_TO_NAME:
            raise errors.InvalidRequestError(f"Unknown mode {request.mode}.")
        settings, view = self.shard.change_config(
            mode=MODE_TO_NAME.get(request.mode, ""),
            learning_rate=request.learning_rate if request.HasField("learning_rate") else None,
            at_version=request.at_version if request.HasField("at_version") else None,
            **changes,
        )
        scheduled = view.membership.config_changes[-1]
        lr = request.learning_rate if request.HasField("learning_rate") else view.learning_rate
        return ps_pb2.UpdateConfigResponse(
            config=cluster_config(settings, self.shard.lease_timeout, lr),
            pending_mode=NAME_TO_MODE[view.pending_mode] if view.pending_mode else ps_pb2.MODE_UNSPECIFIED,
            at_version=scheduled.version,
            membership_epoch=scheduled.epoch,
        )

    @maps_errors
    def Resize(self, request: ps_pb2.ResizeRequest, context: grpc.ServicerContext) -> ps_pb2.ResizeResponse:
        previous, at, num_workers, epoch = self.shard.resize_request(
            request.num_workers, request.at_version if request.HasField("at_version") else None
        )
        return ps_pb2.ResizeResponse(
            previous_num_workers=previous, num_workers=num_workers, at_version=at, membership_epoch=epoch
        )

    @maps_errors
    def Checkpoint(self, request: ps_pb2.CheckpointRequest, context: grpc.ServicerContext) -> ps_pb2.CheckpointResponse:
        if self.checkpointer is None:
            raise errors.PreconditionError("This shard has no --checkpoint-dir; restart it with one to checkpoint.")
        version, path, seconds = self.checkpointer.checkpoint_now()
        # absolute: a relative --checkpoint-dir means nothing to an operator in another directory
        return ps_pb2.CheckpointResponse(version=version, path=os.path.abspath(path), seconds=seconds)

    @maps_errors
    def EvictWorker(
        self, request: ps_pb2.EvictWorkerRequest, context: grpc.ServicerContext
    ) -> ps_pb2.EvictWorkerResponse:
        previous, version = self.shard.evict(request.rank)
        return ps_pb2.EvictWorkerResponse(previous_state=WORKER_STATES[previous], version=version)

    @maps_stream_errors
    def ExportParameters(
        self, request: ps_pb2.ExportParametersRequest, context: grpc.ServicerContext
    ) -> Iterator[ps_pb2.ExportParametersResponse]:
        """The shard's plan, then each partition it owns, at one version (``ps-admin export``)."""
        yield from export_messages(self.shard)  # ps_server.checkpoint.export; bytes counted by the metrics interceptor
