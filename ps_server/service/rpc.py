"""What both servicers of a shard share: a domain error becomes ``context.abort`` with its status
code (its class's ``status``, ``ps_common.errors``: one table for both sides) and its ``ps-reason``;
request deadlines, wire dtypes, raw requests and the ClusterConfig message."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from ps_common import errors, modes
from ps_common.codec import dtype_from_proto
from ps_common.modes import ModeSettings
from ps_common.text import shown
from ps_common.wire import NAME_TO_MODE
from ps_proto.v1 import ps_pb2
from ps_server.membership.ranks import PushResult, PushStamp, WorkerState
from ps_server.shard.waits import Call

log = logging.getLogger(__name__)

WORKER_STATES = {
    WorkerState.PENDING: ps_pb2.WORKER_STATE_PENDING,
    WorkerState.LIVE: ps_pb2.WORKER_STATE_LIVE,
    WorkerState.EVICTED: ps_pb2.WORKER_STATE_EVICTED,
    WorkerState.LEFT: ps_pb2.WORKER_STATE_LEFT,
}

F = TypeVar("F", bound=Callable[..., Any])


def status_code(exc: errors.PSError) -> grpc.StatusCode:
    """The status code of a domain error (its class's ``status``, ``ps_common.errors``)."""
    return exc.status


def refuse(servicer: Any, name: str, exc: errors.PSError, context: grpc.ServicerContext) -> None:
    """Count the refused request, log it, and abort the call with the error's code and reason."""
    servicer.counters.add(rejected=1)
    code = status_code(exc)
    level = logging.INFO if code == grpc.StatusCode.DEADLINE_EXCEEDED else logging.WARNING
    message = shown(str(exc))  # client text escaped and cut short: one log line, a detail gRPC can send
    log.log(level, "%s refused (%s): %s", name, code.name, message)
    context.set_trailing_metadata(((errors.REASON_KEY, str(exc.reason)),))
    context.abort(code, message)


def maps_errors(method: F) -> F:
    """Unary or client-streaming method: a domain error becomes ``context.abort`` with its code; its
    waits end with the call (:class:`ps_server.shard.waits.Call`)."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            with Call(context.is_active, context.time_remaining):
                return method(self, request, context)
        except errors.PSError as exc:
            refuse(self, method.__name__, exc, context)

    return wrapper  # type: ignore[return-value]


def maps_stream_errors(method: F) -> F:
    """Server-streaming method: like :func:`maps_errors`, for errors raised while iterating."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            with Call(context.is_active, context.time_remaining):
                yield from method(self, request, context)
        except errors.PSError as exc:
            refuse(self, method.__name__, exc, context)

    return wrapper  # type: ignore[return-value]


def wire_dtype(value: int) -> str:
    """The wire dtype name of a request's ``wire_dtype`` ("" when unset).

    Raises:
        InvalidRequestError: an unknown value.
    """
    return "" if value == ps_pb2.DTYPE_UNSPECIFIED else dtype_from_proto(value)


def deadline(context: grpc.ServicerContext) -> float | None:
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
        **modes.config_fields(settings),
    )


def parse(cls: type[Any], raw: bytes) -> Any:
    """``cls.FromString(raw)``.

    Raises:
        InvalidRequestError: the bytes do not parse.
    """
    try:
        return cls.FromString(raw)
    except Exception:
        raise errors.InvalidRequestError(f"Malformed {cls.__name__}; send a valid ps.v1 message.") from None


def push_response(
    r: PushResult,
    checkpointed: int | None = None,
    told: tuple[int, ps_pb2.MembershipEpoch | None] = (0, None),
) -> ps_pb2.PushResponse:
    """The PushResponse of a push result; ``checkpointed``: the shard's ``redo_from``; ``told``: the
    shard's membership epoch and the record the requester should learn (``DataCalls.push_pull``)."""
    epoch, record = told
    return ps_pb2.PushResponse(
        version=r.version,
        duplicate=r.duplicate,
        staleness=r.staleness,
        dropped=r.dropped,
        mode=NAME_TO_MODE[r.mode],
        skipped=r.skipped,
        checkpointed_version=checkpointed,
        membership_epoch=epoch,
        membership=record,
    )


def push_stamp(header: ps_pb2.PushHeader) -> PushStamp:
    """The stamp of a push's header: (rank, incarnation, clock) and diloco's sample count — None
    when the field is unset (the rank does not count samples), 0 when it counted none."""
    samples = header.sample_count if header.HasField("sample_count") else None
    return PushStamp(header.rank, header.incarnation, header.clock, samples)
