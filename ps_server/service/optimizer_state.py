"""The optimizer-state RPCs of ``ps.v1.ParameterService`` (PullOptimizerState, PushOptimizerState,
CommitOptimizerState): check the caller, make the shard calls, encode the answer; what the shard
does is :mod:`ps_server.shard.optimizer_state`.

:class:`OptimizerStateRpcs` is held by :class:`~ps_server.service.parameters.ParameterServicer`.
Every request names the caller's rank, incarnation and session (checked as a push's are: the
rank's token with ``--rank-tokens``, then its session here); the two that carry state name the
plan (its digest). A push is bounded before it is held: each value is checked as it arrives
(``StateIntake``: owned partition, known name, exact size, sent once), so the stream holds at most
every trained partition's every state value, and at most that many messages plus one are read.
A refused push stages nothing and leaves the state as it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc
import torch

from ps_common.codec import dtype_name, dtype_to_proto
from ps_common.errors import InvalidRequestError
from ps_common.frames import PARTITION_OVERHEAD_BYTES
from ps_proto.v1 import ps_pb2
from ps_server.service.rank_tokens import RankTokens, check_caller
from ps_server.service.rpc import maps_errors, maps_stream_errors
from ps_server.shard.optimizer_state import StateIntake, StateValue

if TYPE_CHECKING:
    from ps_server.shard.counters import ShardCounters
    from ps_server.shard.shard import Shard


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The elements of ``t`` (any shape, any dtype: bfloat16 too), little-endian."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def state_messages(version: int, values: list[StateValue], budget: int) -> Iterator[ps_pb2.PullOptimizerStateResponse]:
    """The PullOptimizerState answer: ``values`` in messages of at most ``budget`` bytes (data,
    names and ``PARTITION_OVERHEAD_BYTES`` per value), or of one value (at most a partition's
    bytes): a message fits the client's channel (``partition_bytes`` plus framing)."""
    msg, used = ps_pb2.PullOptimizerStateResponse(version=version), 0
    for v in values:
        data = tensor_bytes(v.tensor)
        size = len(data) + len(v.key) + len(v.name) + PARTITION_OVERHEAD_BYTES
        if msg.values and used + size > budget:
            yield msg
            msg, used = ps_pb2.PullOptimizerStateResponse(version=version), 0
        msg.values.add(
            key=v.key,
            offset=v.offset,
            name=v.name,
            dtype=dtype_to_proto(dtype_name(v.tensor.dtype)),
            scalar=v.scalar,
            data=data,
        )
        used += size
    yield msg


class OptimizerStateRpcs:
    """PullOptimizerState, PushOptimizerState and CommitOptimizerState (see the module docstring).

    Args:
        shard: the shard served. counters: where refused requests are counted (``rejected_requests``).
        rank_tokens: per-rank credentials (``--rank-tokens``), or None.
    """

    def __init__(self, shard: Shard, counters: ShardCounters, rank_tokens: RankTokens | None) -> None:
        self.shard = shard
        self.counters = counters
        self.rank_tokens = rank_tokens

    @maps_stream_errors
    def PullOptimizerState(
        self, request: ps_pb2.PullOptimizerStateRequest, context: grpc.ServicerContext
    ) -> Iterator[ps_pb2.PullOptimizerStateResponse]:
        check_caller(context, request.rank, "PullOptimizerState", self.rank_tokens)
        what = "PullOptimizerState"
        plan = self.shard.check_request(request.plan_digest, request.rank, request.incarnation, request.session, what)
        version, values = self.shard.read_optimizer_state()
        yield from state_messages(version, values, plan.partition_bytes)

    @maps_errors
    def PushOptimizerState(
        self, request_iterator: Iterator[ps_pb2.PushOptimizerStateRequest], context: grpc.ServicerContext
    ) -> ps_pb2.PushOptimizerStateResponse:
        first = next(request_iterator, None)
        if first is None:
            raise InvalidRequestError("PushOptimizerState sent no message; the first names the rank and plan.")
        check_caller(context, first.rank, "PushOptimizerState", self.rank_tokens)
        self.shard.check_request(first.plan_digest, first.rank, first.incarnation, first.session, "PushOptimizerState")
        layout = self.shard.optimizer_state_layout()
        intake = StateIntake(layout)
        messages = 0
        for msg in _chain(first, request_iterator):
            messages += 1
            if messages > layout.values + 1:
                raise InvalidRequestError(
                    f"PushOptimizerState sent more than {layout.values + 1} messages; this shard's state has "
                    f"{layout.values} values."
                )
            for value in msg.values:
                intake.add(value)
        state = intake.finish()
        stage = self.shard.stage_optimizer_state(layout, state)
        return ps_pb2.PushOptimizerStateResponse(stage=stage, partitions=len(state))

    @maps_errors
    def CommitOptimizerState(
        self, request: ps_pb2.CommitOptimizerStateRequest, context: grpc.ServicerContext
    ) -> ps_pb2.CommitOptimizerStateResponse:
        check_caller(context, request.rank, "CommitOptimizerState", self.rank_tokens)
        self.shard.check_session(request.rank, request.incarnation, request.session, "CommitOptimizerState")
        return ps_pb2.CommitOptimizerStateResponse(version=self.shard.commit_optimizer_state(request.stage))


def _chain(
    first: ps_pb2.PushOptimizerStateRequest, rest: Iterator[ps_pb2.PushOptimizerStateRequest]
) -> Iterator[ps_pb2.PushOptimizerStateRequest]:
    yield first
    yield from rest
