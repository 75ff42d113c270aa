"""The data-path servicer of a shard (``ps.v1.ParameterService``): decode, call
:class:`~ps_server.shard.shard.Shard`, encode. Reads are encoded through the shard's
:class:`~ps_server.service.frame_cache.FrameCache`; every accepted push is counted in the shard's
counters (``ShardCounters.pushed``), the numbers GetStatus and Prometheus report.

Domain errors become status codes through their class's ``status`` (``ps_common.errors``, one table
for both sides; :mod:`ps_server.service.rpc`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, TypeVar

import grpc

from ps_common import fields, frames, tracing
from ps_common.errors import InvalidRequestError, WrongRankError
from ps_common.fragments import fragments_in_force
from ps_common.optimizer import OptimizerSpec
from ps_common.plan import Plan
from ps_common.wire import SpecList, hyperparameters_from_proto, optimizer_from_proto, optimizer_to_proto
from ps_proto.v1 import ps_pb2
from ps_server.core.partitions import Intake
from ps_server.dataplane.connections import DataPlane
from ps_server.dataplane.pushpull import DataPushPull
from ps_server.membership.ranks import PushStamp
from ps_server.service.chain import HANDLER_MAKERS
from ps_server.service.frame_cache import FrameCache, encode_exchange
from ps_server.service.optimizer_state import OptimizerStateRpcs
from ps_server.service.rank_tokens import RankTokens, check_caller
from ps_server.service.request_streams import Request, read_request
from ps_server.service.rpc import (
    WORKER_STATES,
    cluster_config,
    deadline,
    maps_errors,
    maps_stream_errors,
    parse,
    push_response,
    push_stamp,
    wire_dtype,
)
from ps_server.service.tables import TableRpcs
from ps_server.shard.counters import ShardCounters
from ps_server.shard.shard import Shard
from ps_server.tables.reads import TableReads

T = TypeVar("T")

log = logging.getLogger(__name__)

SMALL_FRAME_BYTES = 64 * 1024
"""A first PushPull frame up to this many bytes, or the only one, gets the push's answer prepended (a
copy); larger ones are sent after a message of their own with the answer."""


PUSH_PULL_ONCE_METHOD = "ps.v1.ParameterService/PushPullOnce"
"""The span name of a PushPullOnce, on gRPC or on a data connection (:mod:`ps_common.tracing`)."""

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
        # others' undecodable bytes are refused by ps_server.service.decoding.Decoding)
        deserializer = None if method.name in RAW_METHODS else request_cls.FromString
        serializer = None if method.name in RAW_RESPONSES else response_cls.SerializeToString
        make = HANDLER_MAKERS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(servicer, method.name), request_deserializer=deserializer, response_serializer=serializer
        )
    return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)


class ParameterServicer:
    """ps.v1.ParameterService over one :class:`Shard`. Not the generated servicer base: the data
    methods take and return ``bytes`` (see :func:`parameter_service_handler`, which registers it).

    Args:
        shard: the shard served.
        counters: where refused requests (``rejected_requests``) and accepted pushes (Push, PushPull)
            are counted.
        rank_tokens: per-rank credentials (``--rank-tokens``): every request stamped with a rank
            its caller may not act as is refused (WRONG_RANK) before anything changes
            (:func:`ps_server.service.rank_tokens.check_caller`).
        table_reads: where PullRows' reads run, at the lowest CPU priority (``ps_server.tables.reads``);
            None: on the calling thread.
    """

    def __init__(
        self,
        shard: Shard,
        counters: ShardCounters,
        data: DataPlane | None = None,
        rank_tokens: RankTokens | None = None,
        table_reads: TableReads | None = None,
    ) -> None:
        self.shard = shard
        self.rank_tokens = rank_tokens
        self.counters = counters
        self.frames = FrameCache()
        self.tables = TableRpcs(shard, counters, rank_tokens, table_reads)
        """InitTables, PullRows and PushRows (``ps_server.service.tables``)."""
        self.optimizer_state = OptimizerStateRpcs(shard, counters, rank_tokens)
        """PullOptimizerState, PushOptimizerState, CommitOptimizerState (``ps_server.service.optimizer_state``)."""
        self.data_push_pull = DataPushPull(shard, data, counters, self._adopt)
        """PushPull whose partitions come on a data connection (``ps_server.dataplane.pushpull``)."""

    @property
    def data(self) -> DataPlane | None:
        """The shard's data connections (None: PushPull's partitions travel on gRPC only); set once
        the data plane listens, after the servicer is built."""
        return self.data_push_pull.data

    @data.setter
    def data(self, data: DataPlane | None) -> None:
        self.data_push_pull.data = data

    def _caller_is(self, context: Any, rank: int, what: str) -> None:
        """Refuse a request stamped with ``rank`` its caller's token may not act as (WrongRankError)."""
        check_caller(context, rank, what, self.rank_tokens)

    @maps_errors
    def Join(self, request: ps_pb2.JoinRequest, context: grpc.ServicerContext) -> ps_pb2.JoinResponse:
        # the record a Join relays is followed before its own checks (ShardMembers.join_relaying)
        self._caller_is(context, request.rank, "Join")
        info = self.shard.join_relaying(
            request.rank, request.num_workers, request.incarnation, request.membership_epoch, _relayed(request)
        )
        return ps_pb2.JoinResponse(
            membership=info.membership,
            shard_index=self.shard.shard_index,
            num_shards=self.shard.num_shards,
            config=cluster_config(info.settings, self.shard.lease_timeout, info.learning_rate),
            initialized=info.initialized,
            version=info.version,
            plan_digest=info.plan_digest,
            clock=info.clock,
            optimizer=optimizer_to_proto(info.optimizer) if info.optimizer else None,
            data_port=self.data.port if self.data is not None else 0,
            session=info.session,
            checkpointed_version=self.shard.redo_from,
        )

    def _read(
        self,
        request_iterator: Iterator[bytes | memoryview],
        what: str,
        header_cls: type[Any],
        values: str,
        context: Any,
        peer_rank: int | None = None,
    ) -> Request:
        """Read a Push, PushPull, PushPullOnce or Exchange stream. At its header, before any
        partition is read: the header's rank against the caller's token (``--rank-tokens``) and
        ``peer_rank`` (the hello's rank of the data connection a call came on), the shard's plan
        (initialized, same digest) and the rank's session; then each partition as it arrives.

        Raises:
            WrongRankError: stamped with another rank than the caller's token, the data
                connection's or the session's.
            NotJoinedError: not the rank's current session here (join again).
        """

        def open_(header: Any) -> Intake:
            self._caller_is(context, header.rank, what)
            if peer_rank is not None and header.rank != peer_rank:
                raise WrongRankError(
                    f"{what} stamped rank {header.rank} came on the data connection of rank {peer_rank} (its hello); "
                    "a connection carries only its own rank's calls. Nothing was applied."
                )
            plan = self.shard.check_request(header.plan_digest, header.rank, header.incarnation, header.session, what)
            return Intake(plan, self.shard.shard_index, values)

        return read_request(request_iterator, what, header_cls, open_, what.startswith("PushPull"), _ignore)

    @maps_errors
    def Init(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> ps_pb2.InitResponse:
        opened: list[tuple[SpecList, Plan, OptimizerSpec]] = []

        def open_(header: ps_pb2.InitHeader) -> Intake:
            # rank, optimizer, then the plan: already initialized and the digest first, then its
            # bounds, all before it is built (Shard.init_plan)
            self._caller_is(context, header.rank, "Init")
            self.shard.check_rank(header.rank)
            optimizer = optimizer_from_proto(header.optimizer)
            specs = SpecList(header.plan.specs)
            plan = self.shard.init_plan(specs, header.plan.num_shards, header.plan.partition_bytes, header.plan.digest)
            opened.append((specs, plan, optimizer))
            return Intake(plan, self.shard.shard_index, "value")

        req = read_request(request_iterator, "Init", ps_pb2.InitHeader, open_, False, _ignore)
        (specs, plan, optimizer), info = opened[0], req.header.plan
        applied, version, digest = self.shard.init(
            specs, info.num_shards, info.partition_bytes, info.digest, optimizer, req.parts, plan, req.header.version
        )
        return ps_pb2.InitResponse(applied=applied, version=version, plan_digest=digest)

    @maps_errors
    def Push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> ps_pb2.PushResponse:
        req = self._read(request_iterator, "Push", ps_pb2.PushHeader, "gradient", context)
        h = req.header
        self._adopt(h)
        if h.hold_for_clip:  # sync: the round waits for its clipping coefficient (ps_server.shard.clipping)
            self.shard.request_clip(h.rank, h.clock)
        r = self.shard.push(
            push_stamp(h),
            h.version,
            req.plan,  # the header's, checked (ps_server.service.request_streams)
            req.parts,
            hyperparameters_from_proto(h),
            h.skip,
        )
        self.counters.pushed(r)
        answer = push_response(r, self.shard.redo_from)
        if h.hold_for_clip and not r.dropped:
            round_, sum_squares = self.shard.wait_clip_norm(h.rank, h.clock, deadline(context))
            if sum_squares is None:
                answer.skipped = True
            else:
                answer.clip.CopyFrom(ps_pb2.ClipNorm(round=round_, sum_squares=sum_squares))
        return self._told(answer, h.membership_epoch)

    @maps_stream_errors
    def Pull(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        req = parse(ps_pb2.PullRequest, request)
        self._caller_is(context, req.rank, "Pull")
        dtype = wire_dtype(req.wire_dtype)
        if req.HasField("clip"):  # step the round held for clipping first (ps_server.shard.clipping)
            self.shard.check_plan(req.plan_digest)
            self.shard.apply_clip(req.rank, req.incarnation, req.clip.round, req.clip.coefficient)
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

    def _push_pull(
        self, req: Request, context: grpc.ServicerContext, single: bool, chunks: bool = False
    ) -> list[bytes]:
        """PushPull and PushPullOnce: push, then the messages of the version it lands in; the
        push's answer (field 3) leads the first message (``chunks``, PushPullOnce only: the one
        message as [the answer's field, the version's cached message], not joined)."""
        header, parts, first = req.header, req.parts, req.first
        if header.data_sequence:
            raise InvalidRequestError(
                "PushPullOnce carries its partitions in its one message; data_sequence is for PushPull streams."
            )
        self._adopt(header)
        dtype = wire_dtype(first.ints.get(fields.WIRE_DTYPE, 0))
        index = self.shard.shard_index
        fragment = (fragments_in_force(self.shard.settings), header.clock)  # diloco: the round's fragment
        result, version, out, told = self.shard.push_pull(
            push_stamp(header),
            header.version,
            req.plan,
            parts,
            deadline(context),
            self.frames.encoder(dtype, packed=True, fragment=fragment),
            dtype,
            check=(lambda plan: self.frames.check_single(plan, index, dtype, fragment)) if single else None,
            hyper=hyperparameters_from_proto(header),
            skip=header.skip,
            request_epoch=header.membership_epoch,
        )
        self.counters.pushed(result)
        answer = push_response(result, self.shard.redo_from, told)
        # A response of one message stays one; otherwise a large first frame is not copied to
        # prepend the answer: the answer goes alone, with the version
        lead = frames.bytes_field(fields.PUSH_ANSWER, answer.SerializeToString())
        if chunks:
            (only,) = out  # check_single: one message
            return [lead, only]
        if len(out) == 1 or len(out[0]) <= SMALL_FRAME_BYTES:
            out = [lead + out[0], *out[1:]]
        else:
            out = [lead + frames.uint_field(fields.VERSION, version), *out]
        return out

    @maps_stream_errors
    def PushPull(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        req = self._read(request_iterator, "PushPull", ps_pb2.PushHeader, "gradient", context)
        if req.header.data_sequence:
            yield from self.data_push_pull.push_pull(req, context)
        else:
            yield from self._push_pull(req, context, single=False)

    @maps_errors
    def PushPullOnce(self, request: bytes | memoryview, context: grpc.ServicerContext) -> bytes:
        req = self._read(iter([request]), "PushPullOnce", ps_pb2.PushHeader, "gradient", context)
        (only,) = self._push_pull(req, context, single=True)
        return only

    @maps_errors
    def push_pull_once_chunks(self, request: bytes | memoryview, context: grpc.ServicerContext) -> list[bytes]:
        """PushPullOnce as a call on a data connection (:mod:`ps_server.dataplane.calls`): the same
        response message, as its buffers, sent without joining them (a copy of the whole
        payload per call saved)."""
        peer = getattr(context, "peer_rank", None)
        req = self._read(iter([request]), "PushPullOnce", ps_pb2.PushHeader, "gradient", context, peer_rank=peer)
        with tracing.server_span(PUSH_PULL_ONCE_METHOD, req.header.traceparent, path="data connection"):
            return self._push_pull(req, context, single=True, chunks=True)

    @maps_stream_errors
    def Exchange(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        req = self._read(request_iterator, "Exchange", ps_pb2.ExchangeHeader, "parameter", context)
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
        self._caller_is(context, request.rank, "Heartbeat")
        version, state, epoch, record = self.shard.heartbeat_relaying(
            request.rank, request.incarnation, _relayed(request), request.membership_epoch
        )
        answer = ps_pb2.HeartbeatResponse(
            version=version,
            state=WORKER_STATES[state],
            data_port=self.data.port if self.data is not None else 0,
            checkpointed_version=self.shard.redo_from,
        )
        return _with_epoch(answer, epoch, record)

    @maps_errors
    def Leave(self, request: ps_pb2.LeaveRequest, context: grpc.ServicerContext) -> ps_pb2.LeaveResponse:
        self._caller_is(context, request.rank, "Leave")
        version, epoch, record = self.shard.leave_relaying(
            request.rank, request.incarnation, request.session, _relayed(request), request.membership_epoch
        )
        return _with_epoch(ps_pb2.LeaveResponse(version=version), epoch, record)

    def InitTables(self, request: ps_pb2.InitTablesRequest, context: grpc.ServicerContext) -> ps_pb2.InitTablesResponse:
        return self.tables.InitTables(request, context)

    def PullRows(self, request: ps_pb2.PullRowsRequest, context: grpc.ServicerContext) -> ps_pb2.PullRowsResponse:
        return self.tables.PullRows(request, context)

    def PushRows(self, request: ps_pb2.PushRowsRequest, context: grpc.ServicerContext) -> ps_pb2.PushRowsResponse:
        return self.tables.PushRows(request, context)

    def PullOptimizerState(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        return self.optimizer_state.PullOptimizerState(request, context)

    def PushOptimizerState(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
        return self.optimizer_state.PushOptimizerState(request_iterator, context)

    def CommitOptimizerState(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.optimizer_state.CommitOptimizerState(request, context)

    def _adopt(self, message: Any) -> None:
        """Follow the membership record a request relays, when it is newer than the shard's; called
        once the request passed its own checks (Join: see there)."""
        if message.HasField("membership"):
            self.shard.adopt(message.membership)

    def _told(self, answer: T, request_epoch: int) -> T:
        """``answer`` with the shard's membership epoch, and its record when the requester knows
        an older one (the worker relays it to the shards that are behind)."""
        return _with_epoch(answer, *self.shard.told(request_epoch))


def _relayed(message: Any) -> ps_pb2.MembershipEpoch | None:
    """The membership record a request relays (None if none)."""
    return message.membership if message.HasField("membership") else None


def _with_epoch(answer: T, epoch: int, record: ps_pb2.MembershipEpoch | None) -> T:
    """``answer`` with the shard's membership ``epoch`` and, when given, its ``record``."""
    answer.membership_epoch = epoch  # type: ignore[attr-defined]
    if record is not None:
        answer.membership.CopyFrom(record)  # type: ignore[attr-defined]
    return answer


def _ignore(nbytes: int) -> None:
    """Request bytes are counted by the metrics interceptor (ShardCounters.transferred)."""
