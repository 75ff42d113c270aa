"""Domain errors of grpc-ps; the servicer maps each class to one gRPC status code.

Each class has a ``reason`` that travels in the trailing metadata ``ps-reason`` of the refused
call, so clients can tell apart refusals that share a status code (an evicted rank rejoins, a
restarted shard is re-synchronized) without parsing messages.
"""

from __future__ import annotations


class PSError(Exception):
    """Base class. The message is shown to the caller and says what to do."""

    reason = "ERROR"


class InvalidRequestError(PSError):
    """A request is malformed: unknown key, wrong dtype or length, non-finite values, bad config
    (INVALID_ARGUMENT)."""

    reason = "INVALID"


class UnknownKeyError(InvalidRequestError):
    """A partition names a parameter or a slice this shard does not own (INVALID_ARGUMENT)."""

    reason = "UNKNOWN_KEY"


class PreconditionError(PSError):
    """The shard is not in a state to serve the request (FAILED_PRECONDITION)."""

    reason = "PRECONDITION"


class NotInitializedError(PreconditionError):
    """The shard has not been initialized yet: rank 0 must call Init first."""

    reason = "NOT_INITIALIZED"


class PlanMismatchError(PreconditionError):
    """The caller's plan digest differs from the shard's."""

    reason = "PLAN_MISMATCH"


class NotJoinedError(PreconditionError):
    """The rank is not joined (evicted, left, or the shard restarted): Join again, then pull."""

    reason = "NOT_JOINED"


class SupersededError(PreconditionError):
    """A newer incarnation of the rank has joined; this process is stale and should exit."""

    reason = "SUPERSEDED"


class FutureRoundError(PreconditionError):
    """A sync push for a round the shard has not reached (it restarted from an older checkpoint,
    or the worker did not pull): pull from the shard, then push the round it holds."""

    reason = "FUTURE_ROUND"


class PushLostError(PreconditionError):
    """A sync pull waits for a round that holds no push from this rank: the push it acknowledged
    was lost when the shard restarted from a checkpoint. Push the gradient again, then pull."""

    reason = "PUSH_LOST"


class RanksMissingError(PreconditionError):
    """Ranks never joined within ``--join-timeout`` of the first Join, and a sync round, an ssp read
    or an easgd period waits for them: start them, or evict them to go on without them."""

    reason = "JOIN_TIMEOUT"


class StalePushError(PSError):
    """A push is too old to apply: pull the current parameters and retry (ABORTED)."""

    reason = "STALE"


class ReplayedPushError(StalePushError):
    """A (rank, incarnation, clock) at or below the highest clock this shard applied for the rank,
    and older than the answers it remembers: applied already (or skipped), never applied again
    (ABORTED): pull and push the next clock."""

    reason = "REPLAYED"


class UpdateRefusedError(PSError):
    """An update was refused as a whole (ABORTED): the optimizer step failed, and the parameters,
    optimizer state and version are as they were. Sync mode refuses the whole round; every rank of
    it is told. Pull and push the next gradient."""

    reason = "UPDATE_FAILED"


class NonFiniteUpdateError(UpdateRefusedError):
    """An update (an optimizer step, a sync round's aggregate, an EASGD exchange) would have made
    parameters or optimizer state non-finite, although every value sent was finite; refused as a
    whole, nothing changed (ABORTED)."""

    reason = "NON_FINITE_UPDATE"


class HyperparametersDisagreeError(UpdateRefusedError):
    """The ranks of a sync round sent different hyperparameters (learning rates) for its step: the
    round is refused as a whole, nothing changed (FAILED_PRECONDITION). Every rank must step the
    same lr scheduler the same number of times."""

    reason = "HYPERPARAMETERS_DISAGREE"


class ShuttingDownError(PSError):
    """The shard is stopping (UNAVAILABLE)."""

    reason = "SHUTTING_DOWN"


class WaitTimeoutError(PSError):
    """A wait for a version ran past its deadline (DEADLINE_EXCEEDED)."""

    reason = "WAIT_TIMEOUT"


class CheckpointError(PSError):
    """A checkpoint cannot be written (directory not writable, disk full) or read, or checkpoints
    exist but none of them loads (INTERNAL). The message names the file or directory."""

    reason = "CHECKPOINT"
