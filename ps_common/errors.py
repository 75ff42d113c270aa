"""The errors of grpc-ps, their reasons and their gRPC status codes: one hierarchy for both sides.

A shard raises one of these with a message that says what to do; its servicer aborts the call with
the class's ``status`` and its ``reason`` in the trailing metadata :data:`REASON_KEY`, so clients tell
apart refusals that share a status code (an evicted rank rejoins, a restarted shard is re-synchronized)
without parsing messages. The worker raises the same class again, carrying the shard's ``address``
(:func:`ps_worker.errors.error_from_rpc`, picked by the reason). Each is a ``grpc.RpcError``
(``.code()``, ``.details()``, ``.trailing_metadata()``), so code that branches on ``.code()`` keeps
working; a subclass inherits its parent's ``status``. ``ps_worker.errors`` adds
:class:`~ps_worker.errors.ShardUnreachableError` and keeps the names the worker gave these classes
(in brackets) as aliases::

    PSError [ShardError]                       INTERNAL            ERROR: .address, .reason
    ├── RoundTimeoutError                      DEADLINE_EXCEEDED   (none: the client's deadline on a wait); .ranks
    │   └── WaitTimeoutError [WaitTimeout]                         WAIT_TIMEOUT: the shard's wait ran out
    │       └── AwaitingRanksError [AwaitingRanks]                 AWAITING_RANKS: the awaited ranks are alive
    ├── InvalidRequestError [InvalidRequest]   INVALID_ARGUMENT    INVALID
    │   └── UnknownKeyError [UnknownKey]                           UNKNOWN_KEY
    ├── PreconditionError [PreconditionFailed] FAILED_PRECONDITION PRECONDITION
    │   ├── NotInitializedError [NotInitialized]                   NOT_INITIALIZED (the client re-inits/waits)
    │   ├── PlanMismatchError [PlanMismatch]                       PLAN_MISMATCH
    │   ├── NotJoinedError [NotJoined]                             NOT_JOINED (the client rejoins)
    │   ├── SupersededError [Superseded]                           SUPERSEDED
    │   ├── FutureRoundError [FutureRound]                         FUTURE_ROUND (the client adopts its round)
    │   ├── PushLostError [PushLost]                               PUSH_LOST (the client pushes again)
    │   └── RanksMissingError [JoinTimeout]                        JOIN_TIMEOUT
    ├── StalePushError [StalePush]             ABORTED             STALE
    │   └── ReplayedPushError [Replayed]                           REPLAYED
    ├── UpdateRefusedError [UpdateRefused]     ABORTED             UPDATE_FAILED
    │   ├── NonFiniteUpdateError [NonFiniteUpdate]                 NON_FINITE_UPDATE
    │   └── HyperparametersDisagreeError [HyperparametersDisagree]  FAILED_PRECONDITION HYPERPARAMETERS_DISAGREE
    ├── ShuttingDownError [ShuttingDown]       UNAVAILABLE         SHUTTING_DOWN
    ├── CheckpointError [CheckpointFailed]     INTERNAL            CHECKPOINT
    ├── TooManyStreamsError [TooManyStreams]   RESOURCE_EXHAUSTED  TOO_MANY_STREAMS
    ├── TooManyWaitsError [TooManyWaits]       RESOURCE_EXHAUSTED  TOO_MANY_WAITS (retried)
    ├── VersionAheadError [VersionAhead]       OUT_OF_RANGE        VERSION_AHEAD
    ├── TableFullError [TableFull]             RESOURCE_EXHAUSTED  TABLE_FULL
    ├── RequestTooLargeError [RequestTooLarge] RESOURCE_EXHAUSTED  TOO_LARGE
    ├── WrongRankError [WrongRank]             PERMISSION_DENIED   WRONG_RANK
    └── DataPathError                          UNAVAILABLE         (ERROR) the worker calls again over gRPC
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence

import grpc

REASON_KEY = "ps-reason"
"""Trailing metadata key of a refused call's :class:`Reason`."""


class Reason(enum.StrEnum):
    """Why a shard refused a call (the ``ps-reason`` trailing metadata value)."""

    ERROR = "ERROR"
    INVALID = "INVALID"
    UNKNOWN_KEY = "UNKNOWN_KEY"
    PRECONDITION = "PRECONDITION"
    NOT_INITIALIZED = "NOT_INITIALIZED"
    PLAN_MISMATCH = "PLAN_MISMATCH"
    NOT_JOINED = "NOT_JOINED"
    SUPERSEDED = "SUPERSEDED"
    FUTURE_ROUND = "FUTURE_ROUND"
    PUSH_LOST = "PUSH_LOST"
    JOIN_TIMEOUT = "JOIN_TIMEOUT"
    STALE = "STALE"
    REPLAYED = "REPLAYED"
    UPDATE_FAILED = "UPDATE_FAILED"
    NON_FINITE_UPDATE = "NON_FINITE_UPDATE"
    HYPERPARAMETERS_DISAGREE = "HYPERPARAMETERS_DISAGREE"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    WAIT_TIMEOUT = "WAIT_TIMEOUT"
    AWAITING_RANKS = "AWAITING_RANKS"
    CHECKPOINT = "CHECKPOINT"
    TOO_MANY_STREAMS = "TOO_MANY_STREAMS"
    TABLE_FULL = "TABLE_FULL"
    TOO_LARGE = "TOO_LARGE"
    VERSION_AHEAD = "VERSION_AHEAD"
    TOO_MANY_WAITS = "TOO_MANY_WAITS"
    WRONG_RANK = "WRONG_RANK"


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
        super().__init__(f"{code.name}: {details}" if message is None else message)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


class PSError(StatusError):
    """Base class. The message is shown to the caller and says what to do.

    Raised by the shard, ``code()`` is the class's ``status`` and ``details()`` the message. Raised
    by the worker for a shard's answer (:meth:`answered`), it carries that answer: ``code()``,
    ``details()``, ``trailing_metadata()``, and ``str()`` reads ``HOST:PORT: CODE: details``.

    Attributes:
        address: ``host:port`` of the shard that refused the call ("" where it was raised).
        reason: the class's :class:`Reason`; for a shard's answer the ``ps-reason`` it gave ("" when none).
        deadline: the worker's deadline that ended the call (``ps_worker.transport.retry``), or None.
    """

    reason: str = Reason.ERROR
    deadline: str | None = None
    status = grpc.StatusCode.INTERNAL

    def __init__(
        self,
        message: str = "",
        *,
        address: str = "",
        code: grpc.StatusCode | None = None,
        details: str | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__(code or self.status, message if details is None else details, metadata or (), message)
        self.address = address
        if metadata is not None:  # a shard's answer: the reason it gave
            self.reason = reason_of(self)

    @classmethod
    def answered(
        cls, address: str, code: grpc.StatusCode, details: str, metadata: Sequence[tuple[str, str]] = ()
    ) -> PSError:
        """The error the shard at ``address`` answered a call with (its code, details, trailing metadata)."""
        return cls(cls.text(address, code, details), address=address, code=code, details=details, metadata=metadata)

    @classmethod
    def text(cls, address: str, code: grpc.StatusCode, details: str) -> str:
        """``str()`` of :meth:`answered`'s error."""
        return f"{address}: {code.name}: {details}"


_RANKS = re.compile(r"(?:waits for ranks|: ranks) \[([0-9, ]*)\]")


def _ranks(details: str) -> list[int] | None:
    found = _RANKS.search(details or "")
    return [int(r) for r in found.group(1).replace(" ", "").split(",") if r] if found else None


class RoundTimeoutError(PSError, TimeoutError):
    """A wait ran past the call's deadline (DEADLINE_EXCEEDED): a sync round (or an SSP read) waits
    for ranks that did not push. ``ranks`` lists them when the shard said which (else None); check
    those workers, or ``ps-admin evict RANK`` one that is gone. Without the shard's reason, it is the
    worker's own deadline on a call that may wait (the shard answers before it when a round waits)."""

    status = grpc.StatusCode.DEADLINE_EXCEEDED

    @property
    def ranks(self) -> list[int] | None:
        return _ranks(self.details())

    @classmethod
    def text(cls, address: str, code: grpc.StatusCode, details: str) -> str:
        if _ranks(details) is not None:
            return f"Shard {address}: {details}"
        return (
            f"Shard {address} did not answer in time ({details or code.name}); a sync round or SSP read may "
            "wait for a worker that is gone (ps-admin status shows which), or raise the timeout."
        )


class InvalidRequestError(PSError):
    """A request is malformed: unknown key, wrong dtype or length, non-finite values, bad config
    (INVALID_ARGUMENT)."""

    reason: Reason = Reason.INVALID
    status = grpc.StatusCode.INVALID_ARGUMENT


class UnknownKeyError(InvalidRequestError):
    """A partition names a parameter or a slice this shard does not own (INVALID_ARGUMENT)."""

    reason: Reason = Reason.UNKNOWN_KEY


class PreconditionError(PSError):
    """The shard is not in a state to serve the request (FAILED_PRECONDITION)."""

    reason: Reason = Reason.PRECONDITION
    status = grpc.StatusCode.FAILED_PRECONDITION


class NotInitializedError(PreconditionError):
    """The shard has not been initialized yet: rank 0 must call Init first."""

    reason: Reason = Reason.NOT_INITIALIZED


class PlanMismatchError(PreconditionError):
    """The caller's plan digest differs from the shard's."""

    reason: Reason = Reason.PLAN_MISMATCH


class NotJoinedError(PreconditionError):
    """The rank is not joined (evicted, left, or the shard restarted): Join again, then pull."""

    reason: Reason = Reason.NOT_JOINED


class SupersededError(PreconditionError):
    """A newer incarnation of the rank has joined; this process is stale and should exit."""

    reason: Reason = Reason.SUPERSEDED


class FutureRoundError(PreconditionError):
    """A sync push for a round the shard has not reached (it restarted from an older checkpoint,
    or the worker did not pull): pull from the shard, then push the round it holds."""

    reason: Reason = Reason.FUTURE_ROUND


class PushLostError(PreconditionError):
    """A sync pull waits for a round that holds no push from this rank: the push it acknowledged
    was lost when the shard restarted from a checkpoint. Push the gradient again, then pull."""

    reason: Reason = Reason.PUSH_LOST


class RanksMissingError(PreconditionError):
    """Ranks never joined within ``--join-timeout`` of the first Join, and a sync round, an ssp read
    or an easgd period waits for them: start them, or evict them to go on without them."""

    reason: Reason = Reason.JOIN_TIMEOUT


class StalePushError(PSError):
    """A push is too old to apply: pull the current parameters and retry (ABORTED)."""

    reason: Reason = Reason.STALE
    status = grpc.StatusCode.ABORTED


class ReplayedPushError(StalePushError):
    """A (rank, incarnation, clock) at or below the highest clock this shard applied for the rank,
    and older than the answers it remembers: applied already (or skipped), never applied again
    (ABORTED): pull and push the next clock."""

    reason: Reason = Reason.REPLAYED


class UpdateRefusedError(PSError):
    """An update was refused as a whole (ABORTED): the optimizer step failed, and the parameters,
    optimizer state and version are as they were. Sync mode refuses the whole round; every rank of
    it is told. Pull and push the next gradient."""

    reason: Reason = Reason.UPDATE_FAILED
    status = grpc.StatusCode.ABORTED


class NonFiniteUpdateError(UpdateRefusedError):
    """An update (an optimizer step, a sync round's aggregate, an EASGD exchange) would have made
    parameters or optimizer state non-finite, although every value sent was finite; refused as a
    whole, nothing changed (ABORTED)."""

    reason: Reason = Reason.NON_FINITE_UPDATE


class HyperparametersDisagreeError(UpdateRefusedError):
    """The ranks of a sync round sent different hyperparameters (learning rates) for its step: the
    round is refused as a whole, nothing changed (FAILED_PRECONDITION). Every rank must step the
    same lr scheduler the same number of times."""

    reason: Reason = Reason.HYPERPARAMETERS_DISAGREE
    status = grpc.StatusCode.FAILED_PRECONDITION


class ShuttingDownError(PSError):
    """The shard is stopping (UNAVAILABLE)."""

    reason: Reason = Reason.SHUTTING_DOWN
    status = grpc.StatusCode.UNAVAILABLE


class WaitTimeoutError(RoundTimeoutError):
    """A wait for a version ran past its deadline, and the shard said so, naming the ranks it waits for."""

    reason: Reason = Reason.WAIT_TIMEOUT


class AwaitingRanksError(WaitTimeoutError):
    """A wait for other ranks reached the end of its call while the ranks it waits for still count
    (alive: heartbeating within their leases, or not joined yet within ``--join-timeout``)
    (DEADLINE_EXCEEDED). Nothing failed: the per-RPC deadline bounds a call, not a slow peer, so
    the worker calls again (a repeated push is answered as a duplicate) until they come, or until
    a silent one's lease lapses and it is evicted. The message reads as
    :func:`awaiting_message` writes it; :func:`parse_awaiting` reads it back."""

    reason: Reason = Reason.AWAITING_RANKS


_AWAITING = re.compile(r"waiting for (.+?): ranks \[([0-9, ]*)\] ([^;]+);")


def awaiting_message(what: str, ranks: list[int], state: str) -> str:
    """The text of an :class:`AwaitingRanksError`: ``waiting for <what>: ranks [r, ...] <state>;``
    and what happens next (e.g. ``waiting for round 42: ranks [0] are alive but have not pushed; ...``)."""
    return (
        f"waiting for {what}: ranks {sorted(ranks)} {state}; the call ended at its deadline and the worker calls "
        "again while they are alive (a rank silent past --lease-timeout is evicted and the wait goes on without it)"
    )


def parse_awaiting(details: str) -> tuple[str, list[int], str] | None:
    """(what, ranks, state) of an :func:`awaiting_message` text, None when ``details`` is not one."""
    found = _AWAITING.search(details or "")
    if found is None:
        return None
    return found.group(1), [int(r) for r in found.group(2).replace(" ", "").split(",") if r], found.group(3)


class VersionAheadError(PSError):
    """A read asks for a version no wait can reach now: beyond the version the shard's open round
    makes (OUT_OF_RANGE: the shard's state, not the request's form, puts it out of range). Pull a
    version the shard holds or makes next; a shard that restarted from an older checkpoint is behind
    the worker, which then pulls what it holds."""

    reason: Reason = Reason.VERSION_AHEAD
    status = grpc.StatusCode.OUT_OF_RANGE


class CheckpointError(PSError):
    """A checkpoint cannot be written (directory not writable, disk full) or read, or checkpoints
    exist but none of them loads (INTERNAL). The message names the file or directory."""

    reason: Reason = Reason.CHECKPOINT
    status = grpc.StatusCode.INTERNAL


class TableFullError(PSError):
    """A push would create rows beyond a table's per-shard cap (``--max-table-rows``): refused as a
    whole, nothing changed (RESOURCE_EXHAUSTED). Raise the cap, add shards, or shrink the id space."""

    reason: Reason = Reason.TABLE_FULL
    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class RequestTooLargeError(PSError):
    """A request asks for more than one message may carry (rows of a pull, ids of a push), checked
    before any work (RESOURCE_EXHAUSTED): split it into smaller requests."""

    reason: Reason = Reason.TOO_LARGE
    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class WrongRankError(PSError):
    """A request stamped with another rank than the one its caller joined as: its session is another
    rank's, or its data connection's hello named another rank (PERMISSION_DENIED). Nothing changed;
    a worker pushes only as the rank it joined as."""

    reason: Reason = Reason.WRONG_RANK
    status = grpc.StatusCode.PERMISSION_DENIED


class DataPathError(PSError):
    """A PushPull's partitions did not come on its data connection (none open for the rank, the
    connection broke or carried a frame outside the plan): UNAVAILABLE, so the worker calls again
    with the partitions on the gRPC stream. Nothing of the push was applied."""

    status = grpc.StatusCode.UNAVAILABLE


class TooManyStreamsError(PSError):
    """The shard's cap on open streams of this kind is reached (RESOURCE_EXHAUSTED): not worth
    retrying until another stream closes (the message names the flag that sets the cap)."""

    reason: Reason = Reason.TOO_MANY_STREAMS
    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class TooManyWaitsError(PSError):
    """The shard holds ``--max-waiting-calls`` calls that wait (pushes, pulls, table reads) and
    refused one more at once (RESOURCE_EXHAUSTED): transient, so the worker retries it with backoff."""

    reason: Reason = Reason.TOO_MANY_WAITS
    status = grpc.StatusCode.RESOURCE_EXHAUSTED


_CLASSES = [c for c in list(globals().values()) if isinstance(c, type) and issubclass(c, PSError)]
BY_REASON: dict[str, type[PSError]] = {c.reason: c for c in _CLASSES if "reason" in vars(c)}
"""Reason -> the class that stands for it (each class that names a reason of its own)."""
