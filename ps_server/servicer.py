"""The data-path servicer of a shard (``ps.v1.ParameterService``): decode, call
:class:`~ps_server.shard.Shard`, encode. Reads are encoded through the shard's
:class:`~ps_server.frame_cache.FrameCache`; every accepted push is told to the push observer
(the shard's counters by default), the numbers GetStatus and Prometheus report.

Domain errors become status codes through their class's ``code`` (``ps_common.errors``, one table
for both sides; :mod:`ps_server.rpc`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import torch

from ps_common import dataconn, frames
from ps_common.codec import torch_dtype
from ps_common.errors import DataPathError, InvalidRequestError
from ps_common.optimizer import OptimizerSpec
from ps_common.partition import WirePartition
from ps_common.plan import Plan
from ps_common.wire import NAME_TO_MODE, SpecList, hyperparameters_from_proto, optimizer_from_proto, optimizer_to_proto
from ps_proto.v1 import ps_pb2
from ps_server import round_stream
from ps_server.core.partitions import Intake
from ps_server.counters import PushObserver, ShardCounters
from ps_server.data_plane import POLL_SECONDS, DataPlane, wire_slots
from ps_server.frame_cache import FrameCache, encode_exchange
from ps_server.membership import PushStamp
from ps_server.request_streams import Request, read_request
from ps_server.rpc import WORKER_STATES, cluster_config, deadline, maps_errors, maps_stream_errors, parse, wire_dtype
from ps_server.shard import PushResult, Shard
from ps_server.shard_views import Snapshot
from ps_server.table_servicer import TableRpcs

T = TypeVar("T")

log = logging.getLogger(__name__)

SMALL_FRAME_BYTES = 64 * 1024
"""A first PushPull frame up to this many bytes, or the only one, gets the push's answer prepended (a
copy); larger ones are sent after a message of their own with the answer."""


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


class ParameterServicer(TableRpcs):
    """ps.v1.ParameterService over one :class:`Shard`. Not the generated servicer base: the data
    methods take and return ``bytes`` (see :func:`parameter_service_handler`, which registers it).

    Args:
        shard: the shard served.
        counters: where refused requests are counted (``rejected_requests``).
        observer: told every accepted push (Push, PushPull); ``counters`` by default.
    """

    def __init__(
        self,
        shard: Shard,
        counters: ShardCounters,
        observer: PushObserver | None = None,
        data: DataPlane | None = None,
    ) -> None:
        self.shard = shard
        self.counters = counters
        self.observer: PushObserver = observer or counters
        self.frames = FrameCache()
        self.data = data
        """The shard's data connections (None: PushPull's partitions travel on gRPC only)."""
        self._slots: dict[tuple[int, int, str], list[torch.Tensor]] = {}

    @maps_errors
    def Join(self, request: ps_pb2.JoinRequest, context: grpc.ServicerContext) -> ps_pb2.JoinResponse:
        self._adopt(request)
        info = self.shard.join(request.rank, request.num_workers, request.incarnation)
        return ps_pb2.JoinResponse(
            membership=self.shard.epochs.record,
            shard_index=self.shard.shard_index,
            num_shards=self.shard.num_shards,
            config=cluster_config(self.shard.settings, self.shard.lease_timeout, self.shard.learning_rate()),
            initialized=info.initialized,
            version=info.version,
            plan_digest=info.plan_digest,
            clock=info.clock,
            optimizer=optimizer_to_proto(info.optimizer) if info.optimizer else None,
            data_port=self.data.port if self.data is not None else 0,
        )

    def _read(
        self, request_iterator: Iterator[bytes | memoryview], what: str, header_cls: type[Any], values: str
    ) -> Request:
        """Read a Push, PushPull or Exchange stream: the header is checked against the shard's plan
        (initialized, same digest) before any partition is read, each partition as it arrives."""

        def open_(header: Any) -> Intake:
            return Intake(self.shard.check_plan(header.plan_digest), self.shard.shard_index, values)

        return read_request(request_iterator, what, header_cls, open_, what.startswith("PushPull"), _ignore)

    @maps_errors
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

        req = read_request(request_iterator, "Init", ps_pb2.InitHeader, open_, False, _ignore)
        (specs, plan, optimizer), info = opened[0], req.header.plan
        applied, version, digest = self.shard.init(
            specs, info.num_shards, info.partition_bytes, info.digest, optimizer, req.parts, plan=plan
        )
        return ps_pb2.InitResponse(applied=applied, version=version, plan_digest=digest)

    @maps_errors
    def Push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> ps_pb2.PushResponse:
        req = self._read(request_iterator, "Push", ps_pb2.PushHeader, "gradient")
        h = req.header
        self._adopt(h)
        r = self.shard.push(
            PushStamp(h.rank, h.incarnation, h.clock),
            h.version,
            h.plan_digest,
            req.parts,
            hyperparameters_from_proto(h),
            h.skip,
        )
        self.observer.pushed(r)
        return self._told(push_response(r), h.membership_epoch)

    @maps_stream_errors
    def Pull(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        req = parse(ps_pb2.PullRequest, request)
        dtype = wire_dtype(req.wire_dtype)
        version, out = self.shard.pull(
            req.rank,
            req.incarnation,
            req.min_version,
            req.plan_digest,
            deadline(context),
            dtype,
            self.frames.encoder(dtype, packed=False),
        )
        yield from out

    def _push_pull(self, req: Request, context: grpc.ServicerContext, single: bool) -> list[bytes]:
        """PushPull and PushPullOnce: push, then the messages of the version it lands in; the
        push's answer (field 3) leads the first message."""
        header, parts, first = req.header, req.parts, req.first
        if header.data_sequence:
            raise InvalidRequestError(
                "PushPullOnce carries its partitions in its one message; data_sequence is for PushPull streams."
            )
        self._adopt(header)
        dtype = wire_dtype(first.ints.get(3, 0))
        index = self.shard.shard_index
        result, version, out = self.shard.push_pull(
            PushStamp(header.rank, header.incarnation, header.clock),
            header.version,
            header.plan_digest,
            parts,
            deadline(context),
            self.frames.encoder(dtype, packed=True),
            dtype,
            check=(lambda plan: self.frames.check_single(plan, index, dtype)) if single else None,
            hyper=hyperparameters_from_proto(header),
            skip=header.skip,
        )
        self.observer.pushed(result)
        answer = self._told(push_response(result), header.membership_epoch)
        # A response of one message stays one; otherwise a large first frame is not copied to
        # prepend the answer: the answer goes alone, with the version
        lead = frames.bytes_field(3, answer.SerializeToString())
        if len(out) == 1 or len(out[0]) <= SMALL_FRAME_BYTES:
            out = [lead + out[0], *out[1:]]
        else:
            out = [lead + frames.uint_field(1, version), *out]
        return out

    @maps_stream_errors
    def PushPull(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        req = self._read(request_iterator, "PushPull", ps_pb2.PushHeader, "gradient")
        if req.header.data_sequence:
            yield from self._push_pull_data(req, context)
        else:
            yield from self._push_pull(req, context, single=False)

    def _push_pull_data(self, req: Request, context: grpc.ServicerContext) -> Iterator[bytes]:
        """PushPull with its partitions on the rank's data connection (``data_sequence``): the same
        checks and semantics as on the stream (every partition checked against the plan and for
        finiteness before the push; all or nothing). The values go back on the connection first
        (streamed slot by slot as a streamed round steps them, :mod:`ps_server.round_stream`; else
        as one frame once the round closed), then the push's answer alone on the stream. A call that
        fails after its frame began tells the worker on the connection (:data:`dataconn.ABORT`), so
        the worker never waits there for values that are not coming.

        Raises:
            DataPathError: the frame did not come (the worker sends it again on the stream).
            InvalidRequestError: partitions on the stream too; bad partitions.
        """
        header, first = req.header, req.first
        data = self.data
        if data is None:
            raise DataPathError("This shard has no data connections; send the partitions on the PushPull stream.")
        if req.parts:
            raise InvalidRequestError(
                "A PushPull with data_sequence carries its partitions on the data connection only."
            )
        self._adopt(header)
        dtype = wire_dtype(first.ints.get(3, 0))
        plan = self.shard.check_plan(header.plan_digest)
        rank, incarnation, sequence = header.rank, header.incarnation, header.data_sequence
        stamp = PushStamp(rank, incarnation, header.clock)
        hyper = hyperparameters_from_proto(header)
        told = False  # the worker has the answer's end (values, or an ABORT) on its connection
        stream: round_stream.RoundStream | None = None
        try:
            setting = self.shard.stream_rounds
            if setting == "auto" and data.loopback(rank):
                setting = "off"  # on one machine the link is a memory copy: nothing to overlap
            with self.shard._cond:
                stream = round_stream.join(self.shard, stamp, hyper, header.skip, setting)
            if stream is not None:
                parts = self._stream_slots(stream, plan, stamp, sequence, dtype, context)
            else:
                intake = Intake(plan, self.shard.shard_index, "gradient")
                taken = data.take(rank, incarnation, sequence, deadline(context), context.is_active)
                parts = [intake.add(p) for p in taken]
            result, version, (epoch, slots, live) = self.shard.push_pull(
                stamp,
                header.version,
                header.plan_digest,
                parts,
                deadline(context),
                self._slot_encoder(dtype, lazy=stream is not None),
                dtype,
                hyper=hyper,
                skip=header.skip,
                stream=stream,
            )
            if stream is not None and stream.committed and stream.round + 1 == version:
                data.send_records(rank, incarnation, sequence, [dataconn.end(sequence, len(slots))], 5.0)
                live = False
            else:
                if stream is not None:  # it ended: drop the speculative values, the round's follow
                    data.send_records(rank, incarnation, sequence, [dataconn.marker(sequence, dataconn.ABORT, 1)], 5.0)
                    slots = wire_slots(slots, torch_dtype(dtype) if dtype else None, copy=False)
                data.send(rank, incarnation, sequence, slots, context.time_remaining())
            told = True
        finally:
            if stream is not None and not told:
                with self.shard._cond:
                    if stream.live and rank not in stream.pushed:
                        round_stream.end(self.shard, f"rank {rank}'s streamed call failed")
            if not told:
                try:
                    data.send_records(rank, incarnation, sequence, [dataconn.marker(sequence, dataconn.ABORT, 0)], 1.0)
                except DataPathError:
                    pass  # no connection: the worker's receive fails with it
        self.observer.pushed(result)
        if live and self.shard.values_key() != (version, epoch):
            # the parameters were sent from their own memory and a round closed meanwhile (a
            # quorum round, an eviction): the values may mix two versions. The call fails and the
            # worker pushes the same stamp again on gRPC, answered as a duplicate with one version.
            raise DataPathError(f"Version {version} moved on while it was sent; pull it again.")
        answer = self._told(push_response(result), header.membership_epoch)
        yield (
            frames.bytes_field(3, answer.SerializeToString())
            + frames.uint_field(1, version)
            + frames.uint_field(4, sequence)
        )

    def _stream_slots(
        self,
        stream: round_stream.RoundStream,
        plan: Plan,
        stamp: PushStamp,
        sequence: int,
        dtype: str,
        context: grpc.ServicerContext,
    ) -> list[WirePartition]:
        """A streamed round's part of one rank's PushPull: offer each partition of the rank's frame
        as it lands, and send each slot's new values as soon as the round stepped it (after a
        :data:`dataconn.SPECULATE` marker). Returns the frame's checked partitions for the push.
        When the stream ends early, the rest goes the usual way (the caller sends ABORT).

        Raises:
            DataPathError: the connection closed or the frame did not come in time.
            InvalidRequestError: a bad partition (NaN...); the stream ends.
        """
        shard, data = self.shard, self.data
        assert data is not None
        rank, incarnation = stamp.rank, stamp.incarnation
        intake = Intake(plan, shard.shard_index, "gradient")
        checked: dict[int, WirePartition] = {}
        landed_data: dict[int, bytes | memoryview] = {}
        sent: set[int] = set()
        wait = deadline(context)
        until = None if wait is None else time.monotonic() + wait
        data.send_records(rank, incarnation, sequence, [dataconn.marker(sequence, dataconn.SPECULATE)], wait)
        n = stream.num_slots
        while len(sent) < n:
            with shard._cond:
                while True:
                    landed, _ = data.peek(rank, incarnation, sequence)
                    for slot in sorted(landed.keys() - checked.keys()):
                        landed_data[slot] = landed[slot].data
                        part = intake.add(landed[slot])
                        grad = round_stream.gradient_of(part, plan.dtypes[part.key])
                        if part.dtype != plan.dtypes[part.key]:  # the push holds the widened values
                            part = dataclasses.replace(part, dtype=plan.dtypes[part.key], data=dataconn.byte_view(grad))
                        checked[slot] = part
                        round_stream.offer(shard, stream, rank, slot, grad)
                    round_stream.step_ready(shard, stream)
                    ready = sorted(stream.stepped - sent)
                    if ready or not stream.live:
                        outgoing = [round_stream.wire_values(shard, stream, slot, dtype) for slot in ready]
                        break
                    left = None if until is None else until - time.monotonic()
                    if (left is not None and left <= 0) or not context.is_active():
                        round_stream.end(shard, f"rank {rank}'s call ended waiting for the round's slots")
                        break
                    shard._cond.wait(POLL_SECONDS if left is None else min(POLL_SECONDS, left))
            if not stream.live:
                break
            buffers: list[bytes | memoryview] = []
            for slot, values in zip(ready, outgoing, strict=True):
                buffers += dataconn.record(sequence, slot, values)
            left = None if until is None else until - time.monotonic()
            data.send_records(rank, incarnation, sequence, buffers, left)
            sent.update(ready)
        taken = data.take(
            rank,
            incarnation,
            sequence,
            None if until is None else max(0.0, until - time.monotonic()),
            context.is_active,
        )
        out = []
        for i, part in enumerate(taken):
            mine = checked.get(i)
            out.append(mine if mine is not None and landed_data.get(i) is part.data else intake.add(part))
        return out

    def _slot_encoder(
        self, dtype: str, lazy: bool = False
    ) -> Callable[[Snapshot], tuple[int, list[torch.Tensor], bool]]:
        """A snapshot's partitions for the data connection, under the shard's lock: (store epoch,
        slots, live). sync without a wire dtype, or ``lazy`` (a streamed call, which sends them only
        when its stream ended: the caller casts), the parameters' own memory (``live``; in sync a
        version moves only once every live rank pushed again, so a rank's answer normally goes out
        whole, and the sender checks); otherwise copies made once per (version, store epoch, wire
        dtype), only the newest version's kept."""

        def encode(snapshot: Snapshot) -> tuple[int, list[torch.Tensor], bool]:
            if lazy:
                return snapshot.epoch, list(snapshot.tensors), True
            if not dtype and self.shard.policy.holds_pushes:
                return snapshot.epoch, wire_slots(snapshot.tensors, None, copy=False), True
            key = (snapshot.version, snapshot.epoch, dtype)
            cached = self._slots.get(key)
            if cached is None:
                cached = wire_slots(snapshot.tensors, torch_dtype(dtype) if dtype else None)
                self._slots = {k: v for k, v in self._slots.items() if k[:2] == key[:2]}
                self._slots[key] = cached
            return snapshot.epoch, cached, False

        return encode

    @maps_errors
    def PushPullOnce(self, request: bytes | memoryview, context: grpc.ServicerContext) -> bytes:
        req = self._read(iter([request]), "PushPullOnce", ps_pb2.PushHeader, "gradient")
        (only,) = self._push_pull(req, context, single=True)
        return only

    @maps_stream_errors
    def Exchange(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        req = self._read(request_iterator, "Exchange", ps_pb2.ExchangeHeader, "parameter")
        header, parts = req.header, req.parts
        version, out = self.shard.exchange(
            PushStamp(header.rank, header.incarnation, header.clock),
            header.plan_digest,
            parts,
            deadline(context),
            encode_exchange,
        )
        yield from out

    @maps_errors
    def Heartbeat(self, request: ps_pb2.HeartbeatRequest, context: grpc.ServicerContext) -> ps_pb2.HeartbeatResponse:
        self._adopt(request)
        version, state = self.shard.heartbeat(request.rank, request.incarnation)
        answer = ps_pb2.HeartbeatResponse(
            version=version, state=WORKER_STATES[state], data_port=self.data.port if self.data is not None else 0
        )
        return self._told(answer, request.membership_epoch)

    @maps_errors
    def Leave(self, request: ps_pb2.LeaveRequest, context: grpc.ServicerContext) -> ps_pb2.LeaveResponse:
        self._adopt(request)
        version = self.shard.leave(request.rank, request.incarnation)
        return self._told(ps_pb2.LeaveResponse(version=version), request.membership_epoch)

    def _adopt(self, message: Any) -> None:
        """Follow the membership record a request relays, when it is newer than the shard's."""
        if message.HasField("membership"):
            self.shard.adopt(message.membership)

    def _told(self, answer: T, request_epoch: int) -> T:
        """``answer`` with the shard's membership epoch, and its record when the requester knows
        an older one (the worker relays it to the shards that are behind)."""
        epochs = self.shard.epochs
        answer.membership_epoch = epochs.epoch  # type: ignore[attr-defined]
        record = epochs.for_request(request_epoch)
        if record is not None:
            answer.membership.CopyFrom(record)  # type: ignore[attr-defined]
        return answer


def _ignore(nbytes: int) -> None:
    """Request bytes are counted by the metrics interceptor (ShardCounters.transferred)."""
