"""Domain errors of grpc-ps, their reasons and their gRPC status codes: one table for both sides.

Each class has a ``reason`` (a :class:`Reason`) that travels in the trailing metadata
:data:`REASON_KEY` of the refused call, so clients can tell apart refusals that share a status code
(an evicted rank rejoins, a restarted shard is re-synchronized) without parsing messages, and a
``code``: the name of its ``grpc.StatusCode`` (a subclass inherits its parent's). The servicer
aborts with ``code`` and ``reason``; the worker's exceptions (``ps_worker.errors``) map back.
"""

from __future__ import annotations

import enum
import re

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


class PSError(Exception):
    """Base class. The message is shown to the caller and says what to do."""

    reason: Reason = Reason.ERROR
    code = "INTERNAL"


class InvalidRequestError(PSError):
    """A request is malformed: unknown key, wrong dtype or length, non-finite values, bad config
    (INVALID_ARGUMENT)."""

    reason: Reason = Reason.INVALID
    code = "INVALID_ARGUMENT"


class UnknownKeyError(InvalidRequestError):
    """A partition names a parameter or a slice this shard does not own (INVALID_ARGUMENT)."""

    reason: Reason = Reason.UNKNOWN_KEY


class PreconditionError(PSError):
    """The shard is not in a state to serve the request (FAILED_PRECONDITION)."""

    reason: Reason = Reason.PRECONDITION
    code = "FAILED_PRECONDITION"


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
    code = "ABORTED"


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
    code = "ABORTED"


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
    code = "FAILED_PRECONDITION"


class ShuttingDownError(PSError):
    """The shard is stopping (UNAVAILABLE)."""

    reason: Reason = Reason.SHUTTING_DOWN
    code = "UNAVAILABLE"


class WaitTimeoutError(PSError):
    """A wait for a version ran past its deadline (DEADLINE_EXCEEDED)."""

    reason: Reason = Reason.WAIT_TIMEOUT
    code = "DEADLINE_EXCEEDED"


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
    code = "OUT_OF_RANGE"


class CheckpointError(PSError):
    """A checkpoint cannot be written (directory not writable, disk full) or read, or checkpoints
    exist but none of them loads (INTERNAL). The message names the file or directory."""

    reason: Reason = Reason.CHECKPOINT
    code = "INTERNAL"


class TableFullError(PSError):
    """A push would create rows beyond a table's per-shard cap (``--max-table-rows``): refused as a
    whole, nothing changed (RESOURCE_EXHAUSTED). Raise the cap, add shards, or shrink the id space."""

    reason: Reason = Reason.TABLE_FULL
    code = "RESOURCE_EXHAUSTED"


class RequestTooLargeError(PSError):
    """A request asks for more than one message may carry (rows of a pull, ids of a push), checked
    before any work (RESOURCE_EXHAUSTED): split it into smaller requests."""

    reason: Reason = Reason.TOO_LARGE
    code = "RESOURCE_EXHAUSTED"


class WrongRankError(PSError):
    """A request stamped with another rank than the one its caller joined as: its session is another
    rank's, or its data connection's hello named another rank (PERMISSION_DENIED). Nothing changed;
    a worker pushes only as the rank it joined as."""

    reason: Reason = Reason.WRONG_RANK
    code = "PERMISSION_DENIED"


class DataPathError(PSError):
    """A PushPull's partitions did not come on its data connection (none open for the rank, the
    connection broke or carried a frame outside the plan): UNAVAILABLE, so the worker calls again
    with the partitions on the gRPC stream. Nothing of the push was applied."""

    code = "UNAVAILABLE"
