"""Bounds on what a client may declare or send, derived from the shard's configuration.

An Init declares a plan in a header of a few bytes; building that plan costs time and memory in
proportion to what it declares (``[10**12, 10**12]`` in 1-byte partitions is 10**24 partitions).
:meth:`Limits.check_plan` bounds it from its specs alone, in time linear in the number of keys,
before anything is built.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ps_common.codec import DTYPES
from ps_common.errors import InvalidRequestError
from ps_common.frames import MESSAGE_OVERHEAD_BYTES
from ps_common.plan import DEFAULT_PARTITION_BYTES, MAX_PARTITION_BYTES, ParameterSpec, piece_bytes
from ps_common.text import quote

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""Default ``--max-message-bytes`` (16 MiB)."""

DEFAULT_MAX_PARAMETER_BYTES = 8 * 1024**3
"""Default ``--max-parameter-bytes`` (8 GiB): a model of 2 billion float32 parameters, over all
shards; more than a CPU shard of a small cluster holds, far less than an attacker may declare."""

MAX_DIMS = 64
"""Most dimensions of one parameter (torch's own limit on a tensor's dimensions)."""


@dataclass(frozen=True)
class Limits:
    """What one shard accepts, derived from ``--max-message-bytes`` and ``--max-parameter-bytes``.

    Attributes:
        max_message_bytes: largest gRPC message, bytes.
        max_parameter_bytes: largest model an Init may declare: the bytes of all its parameters
            (every shard's share together).

    Raises:
        InvalidRequestError: a bound below 1 MiB.
    """

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_parameter_bytes: int = DEFAULT_MAX_PARAMETER_BYTES

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1024 * 1024:
            raise InvalidRequestError(f"--max-message-bytes must be >= 1 MiB, got {self.max_message_bytes}.")
        if self.max_parameter_bytes < 1024 * 1024:
            raise InvalidRequestError(f"--max-parameter-bytes must be >= 1 MiB, got {self.max_parameter_bytes}.")

    @property
    def max_keys(self) -> int:
        """Most parameters in a plan: one per 256 bytes of a message (65,536 at 16 MiB). Each key
        costs a spec, at least one partition and a frame in every pull; real models have hundreds
        to a few thousand."""
        return self.max_message_bytes // 256

    @property
    def max_key_bytes(self) -> int:
        """Longest key in UTF-8 bytes: a 16,384th of a message, within [256, 4096] (1 KiB at 16 MiB).
        Every partition on the wire carries its key."""
        return min(4096, max(256, self.max_message_bytes // 16384))

    @property
    def max_partitions(self) -> int:
        """Most partitions in a plan: one per 128 bytes of a message (131,072 at 16 MiB), or four per
        4 MiB of ``max_parameter_bytes`` when that is more. Every partition costs the shard work
        in every request."""
        return max(self.max_message_bytes // 128, 4 * (self.max_parameter_bytes // DEFAULT_PARTITION_BYTES))

    @property
    def max_partition_bytes(self) -> int:
        """Largest ``partition_bytes``: one partition and its frame's header fit in a message."""
        return min(MAX_PARTITION_BYTES, self.max_message_bytes - MESSAGE_OVERHEAD_BYTES)

    def check_key_count(self, n: int) -> None:
        """Raises InvalidRequestError when a plan declares more than :attr:`max_keys` parameters."""
        if n > self.max_keys:
            raise InvalidRequestError(
                f"The plan declares {n} parameters; this shard accepts at most {self.max_keys} "
                "(max_message_bytes / 256): raise --max-message-bytes, or group parameters."
            )

    def check_plan(self, specs: Sequence[ParameterSpec], partition_bytes: int, num_shards: int = 1) -> None:
        """Bound a plan by its inputs, before it is built: key count and length, dimensions,
        bytes and partitions; time linear in ``len(specs)``.

        Args:
            specs: the declared parameters (dtype names are checked by :func:`make_plan`).
            partition_bytes: the declared partition size in bytes.
            num_shards: the shards the plan spreads over (its cut: :func:`ps_common.plan.piece_bytes`).

        Raises:
            InvalidRequestError: a bound exceeded; the message names the flag that sets it.
        """
        self.check_key_count(len(specs))
        if not 1 <= partition_bytes <= self.max_partition_bytes:
            raise InvalidRequestError(
                f"partition_bytes must be in [1, {self.max_partition_bytes}] so a partition fits in one "
                f"message (--max-message-bytes {self.max_message_bytes}), got {partition_bytes}."
            )
        total = partitions = 0
        for spec in specs:
            key_bytes = len(spec.key.encode("utf-8", "replace"))
            if key_bytes > self.max_key_bytes:
                raise InvalidRequestError(
                    f"Parameter key {quote(spec.key)} is longer than {self.max_key_bytes} bytes; "
                    "use the names of model.named_parameters()."
                )
            if len(spec.shape) > MAX_DIMS:
                raise InvalidRequestError(
                    f"Parameter {quote(spec.key)} has {len(spec.shape)} dimensions; at most {MAX_DIMS} are supported."
                )
            dtype = DTYPES.get(spec.dtype)
            size = dtype.itemsize if dtype is not None else 1  # an unknown dtype is refused by make_plan
            numel = math.prod(spec.shape)
            total += numel * size
            if total > self.max_parameter_bytes:
                raise InvalidRequestError(
                    f"The plan declares more than {self.max_parameter_bytes} bytes of parameters (at "
                    f"{quote(spec.key)}, shape {list(spec.shape)[:8]}); this shard accepts at most "
                    f"--max-parameter-bytes {self.max_parameter_bytes}."
                )
            partitions += -(-numel // max(1, partition_bytes // size))
            if partitions > self.max_partitions:
                raise InvalidRequestError(
                    f"The plan cuts its parameters into more than {self.max_partitions} partitions of "
                    f"{partition_bytes} bytes; use a larger partition_bytes (default {DEFAULT_PARTITION_BYTES})."
                )
        # the balanced cut (ps_common.plan.piece_bytes) may cut finer: count its pieces exactly
        piece = piece_bytes(specs, num_shards, partition_bytes)
        if piece < partition_bytes:
            partitions = sum(-(-math.prod(s.shape) // max(1, piece // DTYPES[s.dtype].itemsize)) for s in specs)
            if partitions > self.max_partitions:
                raise InvalidRequestError(
                    f"The plan cuts its parameters into {partitions} partitions (pieces of {piece} bytes, so "
                    f"that {num_shards} shards hold even shares); this shard accepts at most {self.max_partitions}: "
                    "raise --max-message-bytes, or group parameters."
                )
