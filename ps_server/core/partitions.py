"""Matching the partitions of a request against the partitions a shard owns (validation only)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ps_server.core.codec import check_finite, decode
from ps_server.core.errors import InvalidRequestError, UnknownKeyError
from ps_server.core.plan import PartitionSlice, Plan


@dataclass(frozen=True)
class WirePartition:
    """One received partition before validation: raw ``data`` of ``length`` elements of ``dtype``
    (a wire dtype name) at ``offset`` of the flattened parameter ``key``."""

    key: str
    offset: int
    length: int
    dtype: str
    data: bytes


def match_partitions(plan: Plan, shard_index: int, received: Iterable[WirePartition], what: str) -> list[torch.Tensor]:
    """Check that ``received`` is exactly the shard's partitions, each well-formed and finite.

    Args:
        plan: the cluster's plan.
        shard_index: this shard.
        received: partitions in any order.
        what: "gradient" or "value", for messages.

    Returns:
        Read-only 1-D tensors viewing the received bytes, one per owned partition in plan order.

    Raises:
        UnknownKeyError: a key that is not a parameter, or a slice this shard does not own.
        InvalidRequestError: wrong dtype or byte length, a partition sent twice, a missing
            partition, or NaN/infinity.
    """
    owned: Sequence[PartitionSlice] = plan.owned_by(shard_index)
    index = plan.index_of(shard_index)
    dtypes = plan.dtypes
    out: list[torch.Tensor | None] = [None] * len(owned)
    for part in received:
        if part.key not in dtypes:
            raise UnknownKeyError(
                f"Unknown parameter {part.key!r}; this cluster's plan has "
                f"{', '.join(sorted(dtypes)[:8])}{'…' if len(dtypes) > 8 else ''}. "
                "Rebuild the plan from the same model."
            )
        i = index.get((part.key, part.offset))
        if i is None or owned[i].length != part.length:
            raise UnknownKeyError(
                f"Partition {part.key}[{part.offset}:{part.offset + part.length}] is not one this shard "
                f"({shard_index}) owns; compute the plan with the same num_shards and partition_bytes."
            )
        if part.dtype != dtypes[part.key]:
            raise InvalidRequestError(
                f"Partition {part.key}[{part.offset}:] has dtype {part.dtype} but the parameter is "
                f"{dtypes[part.key]}; send {dtypes[part.key]}."
            )
        if out[i] is not None:
            raise InvalidRequestError(f"Partition {part.key}[{part.offset}:] was sent twice in one request.")
        tensor = decode(part.data, part.dtype, part.length)
        check_finite(tensor, f"{what.capitalize()} {part.key}[{part.offset}:{part.offset + part.length}]")
        out[i] = tensor
    missing = [f"{owned[i].key}[{owned[i].offset}:]" for i, t in enumerate(out) if t is None]
    if missing:
        raise InvalidRequestError(
            f"The request misses {len(missing)} of this shard's {len(owned)} partitions "
            f"({', '.join(missing[:4])}{'…' if len(missing) > 4 else ''}); "
            f"send every partition the plan gives shard {shard_index}."
        )
    return [t for t in out if t is not None]
