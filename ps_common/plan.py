"""The partition plan: a deterministic map partition -> shard (docs/architecture.md#6-partition-plan).

Every parameter is flattened and cut into partitions of at most :func:`piece_bytes` (the smaller of
``partition_bytes`` and 1/:data:`BALANCE_PIECES` of a shard's fair share, but not below
:data:`MIN_PIECE_BYTES`); walking parameters in
declaration order, each partition goes to the shard holding the fewest bytes so far (ties to the
lowest shard index). Greedy least-load placement ends with the fullest shard at most one piece above
the mean (Graham, "Bounds on multiprocessing timing anomalies", SIAM J. Appl. Math. 1969), so the
bytes per shard are within about ``1 + 1/BALANCE_PIECES`` of each other whatever the largest
parameter. Workers and shards compute the same plan from the same inputs and compare its digest.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ps_common.codec import itemsize
from ps_common.errors import InvalidRequestError
from ps_common.frames import MESSAGE_OVERHEAD_BYTES, PACKING_VERSION, PARTITION_OVERHEAD_BYTES
from ps_common.text import quote

DEFAULT_PARTITION_BYTES = 4 * 1024 * 1024
"""Default upper bound of one partition's payload, in bytes (4 MiB)."""

MAX_PARTITION_BYTES = 64 * 1024 * 1024

CUT_VERSION = 3
"""Version of the rule that cuts parameters into partitions; the plan digest covers it (from version
2 on). 1: pieces of ``partition_bytes``. 2: pieces of :func:`piece_bytes`, balanced across shards.
3: as 2, no piece below :data:`MIN_PIECE_BYTES`. Checkpoints and shards of versions 1 and 2 are
followed by :func:`plan_for_digest`."""

BALANCE_PIECES = 16
"""Cut version 2 cuts a parameter into pieces of at most 1/16 of a shard's fair share of the model's
bytes, so the fullest shard holds at most about 1/16 above the mean."""

MIN_PIECE_BYTES = 64 * 1024
"""Cut version 3 cuts no piece smaller than this (64 KiB; ``partition_bytes`` when that is smaller):
each partition costs its own work on both sides every step (its fields, its checks, its share of the
optimizer step: tens of microseconds of Python), which a 64 KiB piece's bytes outweigh and a 1 KiB
piece's do not. A model smaller than ``BALANCE_PIECES * num_shards * MIN_PIECE_BYTES`` is then
balanced to within one piece, not 1/16 (bench/README.md "The cost of a step": the digits MLP on two
shards was cut into 35 pieces of 1.2 KB)."""


@dataclass(frozen=True)
class ParameterSpec:
    """One parameter: ``key`` from ``model.named_parameters()``, its shape and wire dtype name
    (one of ``float32``, ``float16``, ``bfloat16``, ``float64``)."""

    key: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        """Number of elements of the flattened parameter."""
        return math.prod(self.shape)


@dataclass(frozen=True, order=True)
class PartitionSlice:
    """Elements ``[offset, offset + length)`` of the flattened parameter ``key``, owned by ``shard``."""

    key: str
    offset: int
    length: int
    shard: int


@dataclass(frozen=True)
class Plan:
    """The partitions of a model over ``num_shards`` shards; build with :func:`make_plan`."""

    specs: tuple[ParameterSpec, ...]
    num_shards: int
    partition_bytes: int
    partitions: tuple[PartitionSlice, ...]
    digest: str

    def owned_by(self, shard: int) -> tuple[PartitionSlice, ...]:
        """Partitions of ``shard`` in plan order."""
        return self._by_shard[shard]

    @functools.cached_property
    def _by_shard(self) -> tuple[tuple[PartitionSlice, ...], ...]:
        return tuple(tuple(p for p in self.partitions if p.shard == k) for k in range(self.num_shards))

    @functools.cached_property
    def dtypes(self) -> dict[str, str]:
        """Parameter key -> wire dtype name."""
        return {s.key: s.dtype for s in self.specs}

    def index_of(self, shard: int) -> dict[tuple[str, int], int]:
        """(key, offset) -> position among ``owned_by(shard)``."""
        return self._index[shard]

    @functools.cached_property
    def _index(self) -> tuple[dict[tuple[str, int], int], ...]:
        return tuple({(p.key, p.offset): i for i, p in enumerate(owned)} for owned in self._by_shard)

    def request_bytes(self, shard: int, sparse: bool = True) -> int:
        """Most bytes a well-formed request carrying ``shard``'s partitions takes on the wire: each
        partition dense (``sparse=False``: values, Init and Exchange) or top-k sparse (gradients:
        up to a 4-byte index per element besides its value), with its key and
        ``frames.PARTITION_OVERHEAD_BYTES``, plus ``frames.MESSAGE_OVERHEAD_BYTES`` for the header."""
        return self._request_bytes[sparse][shard]

    @functools.cached_property
    def _request_bytes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        def total(owned: tuple[PartitionSlice, ...], index_bytes: int) -> int:
            return MESSAGE_OVERHEAD_BYTES + sum(
                p.length * (itemsize(self.dtypes[p.key]) + index_bytes) + len(p.key.encode()) + PARTITION_OVERHEAD_BYTES
                for p in owned
            )

        return tuple(tuple(total(owned, extra) for owned in self._by_shard) for extra in (0, 4))

    def spec(self, key: str) -> ParameterSpec:
        """The spec of ``key``.

        Raises:
            InvalidRequestError: ``key`` is not a parameter of this plan.
        """
        for s in self.specs:
            if s.key == key:
                return s
        raise InvalidRequestError(f"Unknown parameter {quote(key)}; the plan has {len(self.specs)} parameters.")

    def shard_bytes(self) -> list[int]:
        """Payload bytes held by each shard, indexed by shard."""
        loads = [0] * self.num_shards
        by_key = {s.key: s for s in self.specs}
        for p in self.partitions:
            loads[p.shard] += p.length * itemsize(by_key[p.key].dtype)
        return loads


def plan_digest(
    specs: Sequence[ParameterSpec],
    num_shards: int,
    partition_bytes: int,
    packing: int = PACKING_VERSION,
    cut: int = CUT_VERSION,
) -> str:
    """Hex sha256 of the canonical JSON of the plan's inputs (the plan is a pure function of them)
    and of the version of the packing rule (``frames.PACKING_VERSION``) that client and shard must
    share: peers that would cut or pack partitions differently get different digests.
    ``packing=0`` gives the digest of releases before the packing version joined it (their rule is
    version 1's); checkpoints they wrote still restore (:func:`ps_server.shard.state.load_state`).
    ``cut``: :data:`CUT_VERSION`; version 1 (before the cut joined the digest) leaves it out."""
    inputs: dict[str, object] = {"v": 1, "packing": packing}
    if not packing:
        del inputs["packing"]
    if cut >= 2:
        inputs["cut"] = cut
    inputs |= {
        "num_shards": num_shards,
        "partition_bytes": partition_bytes,
        "specs": [[s.key, list(s.shape), s.dtype] for s in specs],
    }
    canonical = json.dumps(inputs, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def piece_bytes(specs: Sequence[ParameterSpec], num_shards: int, partition_bytes: int, cut: int = CUT_VERSION) -> int:
    """Largest payload of one partition, in bytes: ``partition_bytes`` (cut 1), or the smaller of it and
    ``ceil(total bytes / (BALANCE_PIECES * num_shards))`` (cut 2, more than one shard; at least 1:
    one element), that one at least :data:`MIN_PIECE_BYTES` (cut 3). Raises InvalidRequestError for
    an unsupported dtype."""
    if cut < 2 or num_shards <= 1:
        return partition_bytes
    total = sum(s.numel * itemsize(s.dtype) for s in specs)
    balanced = -(-total // (BALANCE_PIECES * max(1, num_shards)))
    return max(1, min(partition_bytes, max(balanced, MIN_PIECE_BYTES) if cut >= 3 else balanced))


def make_plan(
    specs: Iterable[ParameterSpec],
    num_shards: int,
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
    cut: int = CUT_VERSION,
) -> Plan:
    """Cut parameters into partitions and assign them to shards by least load in bytes.

    Args:
        specs: parameters in declaration order; keys must be unique.
        num_shards: number of shards, >= 1.
        partition_bytes: upper bound of one partition's payload in bytes; at least one element.
            Messages pack partitions up to this many bytes whatever the cut.
        cut: the cutting rule (:data:`CUT_VERSION`; 1 for plans of earlier releases).

    Returns:
        The plan, with its digest.

    Raises:
        InvalidRequestError: no parameters, duplicate keys, an empty or unsupported parameter, or
            ``num_shards``/``partition_bytes`` out of range.
    """
    specs = tuple(specs)
    if num_shards < 1:
        raise InvalidRequestError(f"num_shards must be >= 1, got {num_shards}.")
    if not 1 <= partition_bytes <= MAX_PARTITION_BYTES:
        raise InvalidRequestError(f"partition_bytes must be in [1, {MAX_PARTITION_BYTES}], got {partition_bytes}.")
    if not specs:
        raise InvalidRequestError("The model has no parameters; nothing to serve.")
    if not 1 <= cut <= CUT_VERSION:
        raise InvalidRequestError(f"Unknown plan cut version {cut}; this release knows 1 to {CUT_VERSION}.")
    seen: set[str] = set()
    for spec in specs:
        if not spec.key:
            raise InvalidRequestError("A parameter has an empty key.")
        if spec.key in seen:
            raise InvalidRequestError(f"Parameter {quote(spec.key)} appears twice; keys must be unique.")
        seen.add(spec.key)
        if any(d < 0 for d in spec.shape):
            raise InvalidRequestError(f"Parameter {quote(spec.key)} has a negative dimension {spec.shape[:8]}.")
        itemsize(spec.dtype)  # an unsupported dtype is refused before anything is cut
        if spec.numel == 0:
            raise InvalidRequestError(f"Parameter {quote(spec.key)} is empty; remove it from the model.")
    piece = piece_bytes(specs, num_shards, partition_bytes, cut)
    loads = [0] * num_shards
    partitions: list[PartitionSlice] = []
    for spec in specs:
        size = itemsize(spec.dtype)
        numel = spec.numel
        per_part = max(1, piece // size)
        for offset in range(0, numel, per_part):
            length = min(per_part, numel - offset)
            shard = min(range(num_shards), key=lambda k: (loads[k], k))
            loads[shard] += length * size
            partitions.append(PartitionSlice(spec.key, offset, length, shard))
    return Plan(
        specs=specs,
        num_shards=num_shards,
        partition_bytes=partition_bytes,
        partitions=tuple(partitions),
        digest=plan_digest(specs, num_shards, partition_bytes, cut=cut),
    )


def plan_for_digest(specs: Sequence[ParameterSpec], num_shards: int, partition_bytes: int, digest: str) -> Plan:
    """The plan of these inputs whose digest is ``digest``: this release's cut, or cut 2 or 1 (plans
    of earlier releases; cut 1's with or without the packing version in its digest), so that a shard
    or a checkpoint of an earlier release is followed instead of refused. When an earlier cut gives
    the same partitions (one shard, or large pieces) the plan of this release is returned, with its digest.

    Raises:
        InvalidRequestError: no known rule gives ``digest`` (another release's plan algorithm), or
            the inputs are invalid (as :func:`make_plan`).
    """
    plan = make_plan(specs, num_shards, partition_bytes)
    if digest == plan.digest:
        return plan
    earlier_cuts = {
        plan_digest(specs, num_shards, partition_bytes, cut=2): 2,
        plan_digest(specs, num_shards, partition_bytes, cut=1): 1,
        plan_digest(specs, num_shards, partition_bytes, packing=0, cut=1): 1,
    }
    if digest in earlier_cuts:
        earlier = make_plan(specs, num_shards, partition_bytes, cut=earlier_cuts[digest])
        return plan if earlier.partitions == plan.partitions else earlier  # the same layout: today's digest
    raise InvalidRequestError(
        f"Plan digest {quote(digest[:12], 12)} does not match its specs under any plan rule this release "
        f"knows (expected {plan.digest[:12]}); the client and server disagree on the plan algorithm: upgrade "
        "both to the same release."
    )
