"""The errors :class:`~ps_worker.PSClient` raises when a shard refuses a call or cannot be reached.

Each is a ``grpc.RpcError`` (``.code()``, ``.details()``, ``.trailing_metadata()`` as gRPC's own), so
code that branches on ``.code()`` keeps working; they add the shard's address and its ``.reason``
(a :class:`~ps_common.errors.Reason`, "" when the shard gave none). The classes mirror the shard's
domain errors (``ps_common.errors``) one for one: the shard aborts a call with a status code and a
``ps-reason``, and :func:`error_from_rpc` (the one place that maps them) picks the class by reason.
A class's ``status`` is the code the shard sends with its reason; ``reason`` the reason itself::

    ShardError                      a shard refused a call (any status code); .address, .reason
    ├── ShardUnreachableError       no answer within --retry-deadline (not running, wrong address)
    ├── RoundTimeoutError           a sync round / SSP read did not complete in time; .ranks it waits for
    │   └── WaitTimeout             DEADLINE_EXCEEDED  WAIT_TIMEOUT: the shard's wait ran out
    │       └── AwaitingRanks       DEADLINE_EXCEEDED  AWAITING_RANKS: the awaited ranks are alive (called
    │                               again; raised only after wait_timeout, ps_worker.awaiting)
    ├── InvalidRequest              INVALID_ARGUMENT   INVALID: wrong dtype/length, non-finite, bad config
    │   └── UnknownKey              INVALID_ARGUMENT   UNKNOWN_KEY: a key or slice the shard does not own
    ├── PreconditionFailed          FAILED_PRECONDITION PRECONDITION
    │   ├── NotInitialized          NOT_INITIALIZED: rank 0 has not called Init (the client re-inits/waits)
    │   ├── PlanMismatch            PLAN_MISMATCH: another model's plan
    │   ├── NotJoined               NOT_JOINED: evicted, or the shard restarted (the client rejoins)
    │   ├── Superseded              SUPERSEDED: a newer incarnation of this rank joined; exit
    │   ├── FutureRound             FUTURE_ROUND: the shard is behind this push (the client adopts its round)
    │   ├── PushLost                PUSH_LOST: the shard lost an acknowledged push (the client pushes again)
    │   └── JoinTimeout             JOIN_TIMEOUT: ranks never joined within --join-timeout
    ├── StalePush                   ABORTED            STALE: too stale; pull and push the next clock
    │   └── Replayed                ABORTED            REPLAYED: that clock was applied already
    ├── UpdateRefused               ABORTED            UPDATE_FAILED: the optimizer step failed; nothing changed
    │   ├── NonFiniteUpdate         ABORTED            NON_FINITE_UPDATE
    │   └── HyperparametersDisagree FAILED_PRECONDITION HYPERPARAMETERS_DISAGREE: ranks' lrs differ
    ├── ShuttingDown                UNAVAILABLE        SHUTTING_DOWN
    ├── CheckpointFailed            INTERNAL           CHECKPOINT
    ├── TooManyStreams              RESOURCE_EXHAUSTED TOO_MANY_STREAMS: wait for another stream to close
    ├── TooManyWaits                RESOURCE_EXHAUSTED TOO_MANY_WAITS: the shard holds its most waiting calls (retried)
    ├── VersionAhead                OUT_OF_RANGE       VERSION_AHEAD: a read of a version no wait can reach now
    ├── TableFull                   RESOURCE_EXHAUSTED TABLE_FULL: a table's per-shard row cap is reached
    ├── RequestTooLarge             RESOURCE_EXHAUSTED TOO_LARGE: more rows than one message carries
    └── WrongRank                   PERMISSION_DENIED  WRONG_RANK: stamped with another rank than joined as

The session's recoveries (:mod:`ps_worker.session`) branch on these classes: :data:`RECOVERABLE`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import grpc

from ps_common import errors as common
from ps_common.errors import REASON_KEY, Reason

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
    "WrongRank",
    "RECOVERABLE",
    "error_from_rpc",
    "reason_of",
]

HINT_UNREACHABLE = "is the shard running? check --servers (and --tls-ca if the shards serve TLS)"

_RANKS = re.compile(r"(?:waits for ranks|: ranks) \[([0-9, ]*)\]")

_BY_REASON: dict[str, type[ShardError]] = {}
"""Reason -> the class that stands for it (filled by ``ShardError.__init_subclass__``)."""


def reason_of(exc: BaseException) -> str:
    """The ``ps-reason`` a shard attached to a refusal: a :class:`Reason` when it is one grpc-ps
    knows, the raw string otherwise, "" when none (or ``exc`` has no trailing metadata)."""
    try:
        metadata = exc.trailing_metadata() or ()  # type: ignore[attr-defined]
    except (AttributeError, ValueError):
        return ""
    value = next((str(v) for key, v in metadata if key == REASON_KEY), "")
    try:
        return Reason(value) if value else ""
    except ValueError:
        return value


class StatusError(grpc.RpcError):
    """A gRPC status as an exception: ``code()``, ``details()`` and ``trailing_metadata()``, as
    grpcio's own call errors answer them (what the retry and recovery logic reads)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        metadata: Sequence[tuple[str, str]] = (),
        message: str | None = None,
    ) -> None:
        self._code = code
        self._details = details
        self._metadata = tuple(metadata)
        super().__init__(message or f"{code.name}: {details}")

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


class ShardError(StatusError):
    """A call to the shard at ``address`` failed after retries and recoveries.

    Class attributes (of the subclasses that mirror a shard error): ``reason``, the
    :class:`Reason`, and ``status``, the ``grpc.StatusCode`` the shard sends with it.

    Attributes:
        address: ``host:port`` of the shard, as given in ``servers``.
        reason: the shard's ``ps-reason`` (``NOT_JOINED``, ``STALE``, ``WAIT_TIMEOUT``, …), "" when none.
    """

    reason: str = ""
    status: grpc.StatusCode | None = None

    def __init_subclass__(cls, mirrors: type[common.PSError] | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if mirrors is not None:
            cls.reason = mirrors.reason
            cls.status = grpc.StatusCode[mirrors.code]
            _BY_REASON[mirrors.reason] = cls

    def __init__(
        self,
        address: str,
        code: grpc.StatusCode,
        details: str,
        metadata: Sequence[tuple[str, str]] = (),
        message: str | None = None,
    ) -> None:
        self.address = address
        super().__init__(code, details, metadata, message or f"{address}: {code.name}: {details}")
        self.reason = reason_of(self)

    @classmethod
    def from_rpc(cls, address: str, exc: grpc.RpcError, waits: bool = False) -> ShardError:
        """:func:`error_from_rpc` (kept as ``ShardError.from_rpc``, as callers use it)."""
        return error_from_rpc(address, exc, waits)


class ShardUnreachableError(ShardError):
    """No answer from the shard at ``address`` within ``seconds`` (``--retry-deadline``): nothing
    listens there, the address is wrong, or a firewall drops the connection."""

    def __init__(self, address: str, code: grpc.StatusCode, details: str, seconds: float) -> None:
        self.seconds = seconds
        super().__init__(
            address,
            code,
            details,
            message=(
                f"Shard {address} not reachable within {seconds:g} s ({code.name}: {details}); {HINT_UNREACHABLE}; "
                "a shard that is restarting needs a --retry-deadline (PS_RETRY_DEADLINE) longer than its restart."
            ),
        )


class RoundTimeoutError(ShardError, TimeoutError):
    """A wait at the shard ran past the call's deadline: a sync round (or an SSP read) waits for
    ranks that did not push. ``ranks`` lists them when the shard said which (else None); check
    those workers, or ``ps-admin evict RANK`` one that is gone."""

    def __init__(
        self,
        address: str,
        code: grpc.StatusCode,
        details: str,
        metadata: Sequence[tuple[str, str]] = (),
        message: str | None = None,
    ) -> None:
        found = _RANKS.search(details or "")
        self.ranks: list[int] | None = (
            [int(r) for r in found.group(1).replace(" ", "").split(",") if r] if found else None
        )
        if message is not None:
            text = message
        elif self.ranks is not None:
            text = f"Shard {address}: {details}"
        else:
            text = (
                f"Shard {address} did not answer in time ({details or code.name}); a sync round or SSP read may "
                "wait for a worker that is gone (ps-admin status shows which), or raise the timeout."
            )
        super().__init__(address, code, details, metadata, message=text)


class WaitTimeout(RoundTimeoutError, mirrors=common.WaitTimeoutError):
    """The shard's wait for a version (a sync round, an SSP read) ran past the call's deadline and
    the shard said so, naming the ranks it waits for."""


class AwaitingRanks(WaitTimeout, mirrors=common.AwaitingRanksError):
    """The shard's wait for other ranks reached the end of its call while they were alive. The
    client calls again (:class:`ps_worker.awaiting.PeerWaits`) and raises this only once a wait
    lasted ``wait_timeout`` seconds; ``.ranks`` names the ranks it waited for."""


class InvalidRequest(ShardError, mirrors=common.InvalidRequestError):
    """The shard refused a malformed request: wrong dtype or length, non-finite values, bad config."""


class UnknownKey(InvalidRequest, mirrors=common.UnknownKeyError):
    """A partition names a parameter or slice the shard does not own (a different model?)."""


class PreconditionFailed(ShardError, mirrors=common.PreconditionError):
    """The shard is not in a state to serve the call."""


class NotInitialized(PreconditionFailed, mirrors=common.NotInitializedError):
    """The shard holds no parameters: rank 0 has not called Init (or the shard restarted without a
    checkpoint; the client then writes its values again, rank 0, or waits for rank 0)."""


class PlanMismatch(PreconditionFailed, mirrors=common.PlanMismatchError):
    """The shard holds another plan (another model, or another ``partition_bytes``)."""


class NotJoined(PreconditionFailed, mirrors=common.NotJoinedError):
    """The rank is not joined at the shard (evicted after a partition, or the shard restarted):
    the client joins again."""


class Superseded(PreconditionFailed, mirrors=common.SupersededError):
    """A newer incarnation of this rank joined: this process is stale and should exit."""


class FutureRound(PreconditionFailed, mirrors=common.FutureRoundError):
    """A sync push for a round the shard has not reached (it restarted from an older checkpoint):
    the client adopts the shard's round."""


class PushLost(PreconditionFailed, mirrors=common.PushLostError):
    """The shard lost a push it had acknowledged (it restarted from a checkpoint): the client
    adopts its round and pushes the gradient again."""


class JoinTimeout(PreconditionFailed, mirrors=common.RanksMissingError):
    """Ranks never joined within ``--join-timeout`` and a round waits for them: start or evict them."""


class StalePush(ShardError, mirrors=common.StalePushError):
    """A push too stale to apply: pull the current parameters and push the next clock."""


class Replayed(StalePush, mirrors=common.ReplayedPushError):
    """A push whose (rank, incarnation, clock) the shard applied (or skipped) already."""


class UpdateRefused(ShardError, mirrors=common.UpdateRefusedError):
    """An update refused as a whole (the optimizer step failed); nothing changed on the shard."""


class NonFiniteUpdate(UpdateRefused, mirrors=common.NonFiniteUpdateError):
    """An update would have made parameters or optimizer state non-finite; nothing changed."""


class HyperparametersDisagree(UpdateRefused, mirrors=common.HyperparametersDisagreeError):
    """The ranks of a sync round sent different hyperparameters (learning rates): every rank must
    step the same lr scheduler the same number of times."""


class ShuttingDown(ShardError, mirrors=common.ShuttingDownError):
    """The shard is stopping."""


class CheckpointFailed(ShardError, mirrors=common.CheckpointError):
    """The shard could not write or read a checkpoint (the message names the file)."""


class TooManyStreams(ShardError):
    """The shard's cap on open streams of this kind is reached: not worth retrying until another
    stream closes (the message names the flag that sets the cap)."""

    reason = Reason.TOO_MANY_STREAMS
    status = grpc.StatusCode.RESOURCE_EXHAUSTED


_BY_REASON[Reason.TOO_MANY_STREAMS] = TooManyStreams


class TooManyWaits(ShardError):
    """The shard holds ``--max-waiting-calls`` calls that wait (pushes, pulls, table reads) and
    refused one more at once: transient, so the client retries it with backoff."""

    reason = Reason.TOO_MANY_WAITS
    status = grpc.StatusCode.RESOURCE_EXHAUSTED


_BY_REASON[Reason.TOO_MANY_WAITS] = TooManyWaits


class VersionAhead(ShardError, mirrors=common.VersionAheadError):
    """A read asked for a version beyond what the shard's open round makes; nothing waited."""


class TableFull(ShardError, mirrors=common.TableFullError):
    """A push would create rows beyond a table's per-shard cap (``--max-table-rows``); nothing changed."""


class RequestTooLarge(ShardError, mirrors=common.RequestTooLargeError):
    """A request asked for more rows than one message carries; nothing was done. Split it."""


class WrongRank(ShardError, mirrors=common.WrongRankError):
    """A push stamped with another rank than this process joined as (a session or data connection of
    another rank); nothing changed. A bug or a misconfigured rank: not retried."""


RECOVERABLE: tuple[type[ShardError], ...] = (NotJoined, NotInitialized, FutureRound, PushLost)
"""Refusals the session recovers from (rejoin, re-init or wait, adopt the round, push again)."""


def error_from_rpc(address: str, exc: grpc.RpcError, waits: bool = False) -> ShardError:
    """The typed error of ``exc``, a failed call to the shard at ``address``.

    The class is the one of the shard's ``ps-reason`` (see the module docstring); without a reason
    it is :class:`ShardError`, except a deadline on a call that may wait for a round (``waits``:
    Pull, PushPull, Exchange), which is a :class:`RoundTimeoutError` (the shard answers before that
    deadline when a round keeps it waiting, so the client's own deadline ran out). ``exc`` is
    returned as is when already typed.

    Args:
        address: ``host:port`` of the shard.
        exc: the failure (a ``grpc.Call`` error, or anything with ``code()``/``details()``).
        waits: the call may wait for a round.

    Returns:
        A :class:`ShardError` (or subclass) with ``exc``'s code, details and trailing metadata.
    """
    if isinstance(exc, ShardError):
        return exc
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else str(exc)) or ""
    try:
        metadata = tuple(exc.trailing_metadata() or ())
    except (AttributeError, ValueError):
        metadata = ()
    reason = reason_of(exc)
    cls = _BY_REASON.get(reason) if reason else None
    if cls is not None:
        return cls(address, code, details, metadata)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and not reason and waits:
        return RoundTimeoutError(address, code, details, metadata)
    return ShardError(address, code, details, metadata)
