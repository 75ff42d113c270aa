"""Matching the partitions of a request against the partitions a shard owns (validation only)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ps_server.core.codec import check_finite, decode, torch_dtype, wire_dtype_allowed
from ps_server.core.errors import InvalidRequestError, UnknownKeyError
from ps_server.core.plan import PartitionSlice, Plan


@dataclass(frozen=True)
class WirePartition:
    """One received partition before validation: raw ``data`` of ``length`` elements of ``dtype``
    (a wire dtype name) at ``offset`` of the flattened parameter ``key``; with ``indices``
    (uint32 little-endian, ascending), a top-k sparse slice whose ``data`` holds one value per
    index. ``data``/``indices`` are ``bytes`` or byte memoryviews of a received message."""

    key: str
    offset: int
    length: int
    dtype: str
    data: bytes | memoryview
    indices: bytes | memoryview = b""
    finite: bool = False
    """Already checked to hold no NaN or infinity (as each message arrived, overlapping the rest of
    the stream); :func:`match_partitions` then skips the check."""


def densify(part: WirePartition, dtype: torch.dtype, what: str) -> torch.Tensor:
    """The dense 1-D ``dtype`` tensor of shape ``[part.length]`` of a top-k sparse partition.

    Raises:
        InvalidRequestError: indices not 4-byte aligned, not strictly ascending, or out of range;
            a value count that does not match; NaN or infinity.
    """
    where = f"{what.capitalize()} {part.key}[{part.offset}:{part.offset + part.length}]"
    if len(part.indices) % 4:
        raise InvalidRequestError(f"{where}: indices must be uint32 (4 bytes each), got {len(part.indices)} bytes.")
    idx = np.frombuffer(part.indices, dtype="<u4")
    if idx.size and (idx[-1] >= part.length or (idx.size > 1 and not bool((idx[1:] > idx[:-1]).all()))):
        raise InvalidRequestError(
            f"{where}: indices must be strictly ascending and below the partition length {part.length}."
        )
    values = decode(part.data, part.dtype, idx.size)
    check_finite(values, where)
    dense = torch.zeros(part.length, dtype=dtype)
    dense[torch.from_numpy(idx.astype(np.int64))] = values.to(dtype)
    return dense


def match_partitions(
    plan: Plan, shard_index: int, received: Iterable[WirePartition], what: str, sparse_ok: bool | None = None
) -> list[torch.Tensor]:
    """Check that ``received`` is exactly the shard's partitions, each well-formed and finite.

    Args:
        plan: the cluster's plan.
        shard_index: this shard.
        received: partitions in any order.
        what: "gradient" or "value", for messages.
        sparse_ok: accept top-k sparse partitions (default: for gradients only).

    Returns:
        1-D tensors of the parameters' dtypes, one per owned partition in plan order: read-only
        views of the received bytes when the wire dtype is the parameter's, widened copies of
        narrower wire dtypes, dense copies of sparse partitions.

    Raises:
        UnknownKeyError: a key that is not a parameter, or a slice this shard does not own.
        InvalidRequestError: wrong dtype or byte length, a partition sent twice, a missing
            partition, or NaN/infinity.
    """
    owned: Sequence[PartitionSlice] = plan.owned_by(shard_index)
    index = plan.index_of(shard_index)
    dtypes = plan.dtypes
    out: list[torch.Tensor | None] = [None] * len(owned)
    sparse_ok = what == "gradient" if sparse_ok is None else sparse_ok
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
        param_dtype = dtypes[part.key]
        if part.dtype != param_dtype and not wire_dtype_allowed(part.dtype, param_dtype):
            raise InvalidRequestError(
                f"Partition {part.key}[{part.offset}:] has dtype {part.dtype} but the parameter is "
                f"{param_dtype}; send {param_dtype} (or a narrower float: float16/bfloat16 for float32)."
            )
        if out[i] is not None:
            raise InvalidRequestError(f"Partition {part.key}[{part.offset}:] was sent twice in one request.")
        if len(part.indices):
            if not sparse_ok:
                raise InvalidRequestError(f"Only gradients may be sent top-k sparse; send {what}s dense.")
            out[i] = densify(part, torch_dtype(param_dtype), what)
            continue
        tensor = decode(part.data, part.dtype, part.length)
        if not part.finite:
            check_finite(tensor, f"{what.capitalize()} {part.key}[{part.offset}:{part.offset + part.length}]")
        # a narrower wire dtype is widened here, so sums and optimizer steps run in the parameter's dtype
        out[i] = tensor if part.dtype == param_dtype else tensor.to(torch_dtype(param_dtype))
    missing = [f"{owned[i].key}[{owned[i].offset}:]" for i, t in enumerate(out) if t is None]
    if missing:
        raise InvalidRequestError(
            f"The request misses {len(missing)} of this shard's {len(owned)} partitions "
            f"({', '.join(missing[:4])}{'…' if len(missing) > 4 else ''}); "
            f"send every partition the plan gives shard {shard_index}."
        )
    return [t for t in out if t is not None]
