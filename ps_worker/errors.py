"""The errors :class:`~ps_worker.PSClient` raises when a shard refuses a call or cannot be reached.

They are the shard's own classes (``ps_common.errors``: one hierarchy for both sides, its tree in that
module's docstring): the shard aborts a call with a status code and a ``ps-reason``, and
:func:`error_from_rpc` (the one place that maps them back) raises the class of that reason with the
shard's address. Each is a ``grpc.RpcError`` (``.code()``, ``.details()``, ``.trailing_metadata()`` as
gRPC's own), so code that branches on ``.code()`` keeps working. This module adds
:class:`ShardUnreachableError` (no shard answered) and keeps the names the worker's classes had before
as aliases of the shared ones (``ShardError`` is ``PSError``, ``NotJoined`` is ``NotJoinedError``, ...).

The session's recoveries (:mod:`ps_worker.session`) branch on these classes: :data:`RECOVERABLE`.
"""

from __future__ import annotations

import grpc

from ps_common import errors as common
from ps_common.errors import BY_REASON, PSError, RoundTimeoutError, reason_of

__all__ = [
    "ShardError",
    "ShardUnreachableError",
    "RoundTimeoutError",
    "WaitTimeout",
    "AwaitingRanks",
    "InvalidRequest",
    "UnknownKey",
    "PreconditionFailed",
    "NotInitialized",
    "PlanMismatch",
    "NotJoined",
    "Superseded",
    "FutureRound",
    "PushLost",
    "JoinTimeout",
    "StalePush",
    "Replayed",
    "UpdateRefused",
    "NonFiniteUpdate",
    "HyperparametersDisagree",
    "ShuttingDown",
    "CheckpointFailed",
    "TooManyStreams",
    "TooManyWaits",
    "VersionAhead",
    "TableFull",
    "RequestTooLarge",
    "WrongRank",
    "RECOVERABLE",
    "error_from_rpc",
]

HINT_UNREACHABLE = "is the shard running? check --servers (and --tls-ca if the shards serve TLS)"


class ShardUnreachableError(PSError):
    """No answer from the shard at ``address`` within ``seconds`` (``--retry-deadline``): nothing
    listens there, the address is wrong, or a firewall drops the connection."""

    deadline = "retry_deadline"

    def __init__(self, address: str, code: grpc.StatusCode, details: str, seconds: float) -> None:
        self.seconds = seconds
        super().__init__(
            f"Shard {address} not reachable within {seconds:g} s ({code.name}: {details}); {HINT_UNREACHABLE}; "
            "a shard that is restarting needs a --retry-deadline (PS_RETRY_DEADLINE) longer than its restart.",
            address=address,
            code=code,
            details=details,
            metadata=(),
        )


RECOVERABLE: tuple[type[PSError], ...] = (
    common.NotJoinedError,
    common.NotInitializedError,
    common.FutureRoundError,
    common.PushLostError,
)
"""Refusals the session recovers from (rejoin, re-init or wait, adopt the round, push again)."""

# The names these classes had in ps_worker.errors (docs/python-api.md#errors): aliases, the same classes.
ShardError = PSError
WaitTimeout = common.WaitTimeoutError
AwaitingRanks = common.AwaitingRanksError
InvalidRequest = common.InvalidRequestError
UnknownKey = common.UnknownKeyError
PreconditionFailed = common.PreconditionError
NotInitialized = common.NotInitializedError
PlanMismatch = common.PlanMismatchError
NotJoined = common.NotJoinedError
Superseded = common.SupersededError
FutureRound = common.FutureRoundError
PushLost = common.PushLostError
JoinTimeout = common.RanksMissingError
StalePush = common.StalePushError
Replayed = common.ReplayedPushError
UpdateRefused = common.UpdateRefusedError
NonFiniteUpdate = common.NonFiniteUpdateError
HyperparametersDisagree = common.HyperparametersDisagreeError
ShuttingDown = common.ShuttingDownError
CheckpointFailed = common.CheckpointError
TooManyStreams = common.TooManyStreamsError
TooManyWaits = common.TooManyWaitsError
VersionAhead = common.VersionAheadError
TableFull = common.TableFullError
RequestTooLarge = common.RequestTooLargeError
WrongRank = common.WrongRankError


def error_from_rpc(address: str, exc: grpc.RpcError, waits: bool = False) -> PSError:
    """The error of ``exc``, a failed call to the shard at ``address``, as the class of its reason.

    The class is the one of the shard's ``ps-reason`` (``ps_common.errors``); without a reason
    it is :class:`PSError`, except a deadline on a call that may wait for a round (``waits``:
    Pull, PushPull, Exchange), which is a :class:`RoundTimeoutError` (the shard answers before that
    deadline when a round keeps it waiting, so the client's own deadline ran out). ``exc`` is
    returned as is when already one of these.

    Args:
        address: ``host:port`` of the shard.
        exc: the failure (a ``grpc.Call`` error, or anything with ``code()``/``details()``).
        waits: the call may wait for a round.

    Returns:
        A :class:`PSError` (or subclass) with ``exc``'s code, details, trailing metadata and ``deadline``.
    """
    if isinstance(exc, PSError):
        return exc
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else str(exc)) or ""
    try:
        metadata = tuple(exc.trailing_metadata() or ())
    except (AttributeError, ValueError):
        metadata = ()
    reason = reason_of(exc)
    if reason:
        cls = BY_REASON.get(reason, PSError)
    else:
        cls = RoundTimeoutError if waits and code == grpc.StatusCode.DEADLINE_EXCEEDED else PSError
    err = cls.answered(address, code, details, metadata)
    err.deadline = getattr(exc, "deadline", None)  # set by the retry policy (ps_worker.transport.retry)
    return err
