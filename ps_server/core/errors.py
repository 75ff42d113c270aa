"""Domain errors of grpc-ps; the servicer maps each class to one gRPC status code."""

from __future__ import annotations


class PSError(Exception):
    """Base class. The message is shown to the caller and says what to do."""


class InvalidRequestError(PSError):
    """A request is malformed: unknown key, wrong dtype or length, non-finite values, bad config
    (INVALID_ARGUMENT)."""


class UnknownKeyError(InvalidRequestError):
    """A partition names a parameter or a slice this shard does not own (INVALID_ARGUMENT)."""


class PreconditionError(PSError):
    """The shard is not in a state to serve the request (FAILED_PRECONDITION)."""


class NotInitializedError(PreconditionError):
    """The shard has not been initialized yet: rank 0 must call Init first."""


class PlanMismatchError(PreconditionError):
    """The caller's plan digest differs from the shard's."""


class StalePushError(PSError):
    """A push is too old to apply: pull the current parameters and retry (ABORTED)."""


class ShuttingDownError(PSError):
    """The shard is stopping (UNAVAILABLE)."""


class WaitTimeoutError(PSError):
    """A wait for a version ran past its deadline (DEADLINE_EXCEEDED)."""


class CheckpointError(PSError):
    """A checkpoint cannot be written (directory not writable, disk full) or read, or checkpoints
    exist but none of them loads (INTERNAL). The message names the file or directory."""
