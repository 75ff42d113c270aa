"""Matching the partitions of a request against the partitions a shard owns (validation only)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from ps_common.codec import DTYPES, check_finite, decode, torch_dtype, wire_dtype_allowed
from ps_common.errors import InvalidRequestError, UnknownKeyError
from ps_common.partition import WirePartition
from ps_common.plan import PartitionSlice, Plan
from ps_common.text import quote

ITEMSIZES = {name: dtype.itemsize for name, dtype in DTYPES.items()}
"""Bytes per element of each wire dtype."""


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


def check_dtype(key: str, offset: int, dtype: str, param_dtype: str) -> int:
    """The partition rule's dtype half: a partition of parameter ``key`` (starting at element
    ``offset``) is sent in the parameter's dtype ``param_dtype`` or a narrower float the wire allows
    (:func:`ps_common.codec.wire_dtype_allowed`). Returns the bytes per element of ``dtype``.

    Raises:
        InvalidRequestError: any other dtype.
    """
    if dtype != param_dtype and not wire_dtype_allowed(dtype, param_dtype):
        raise InvalidRequestError(
            f"Partition {key}[{offset}:] has dtype {dtype} but the parameter is "
            f"{param_dtype}; send {param_dtype} (or a narrower float: float16/bfloat16 for float32)."
        )
    return ITEMSIZES[dtype]  # known: the parameter's dtype, or one wire_dtype_allowed knows


def check_dense_bytes(key: str, offset: int, length: int, dtype: str, nbytes: int) -> None:
    """The partition rule's byte-count half: a dense partition of ``length`` elements of ``dtype``
    (one :func:`check_dtype` admitted) carries exactly ``length * itemsize`` bytes.

    Raises:
        InvalidRequestError: ``nbytes`` is any other count.
    """
    need = length * ITEMSIZES[dtype]
    if nbytes != need:
        raise InvalidRequestError(
            f"Partition {key}[{offset}:{offset + length}] carries {nbytes} bytes but {length} elements of {dtype} "
            f"need {need}; send exactly the slice the plan names."
        )


class Intake:
    """Checks the partitions of one request as they arrive, against the plan: a stream is refused
    at its first bad frame, and never holds more than about the plan's share of this shard.

    Each partition must name a slice this shard owns, once, in an allowed dtype, with exactly the
    bytes its length needs; its values are read once, here: checked finite, widened to the
    parameter's dtype, kept for :meth:`matched`. :meth:`charge` counts the request's bytes against
    :attr:`budget`.

    Args:
        plan: the cluster's plan.
        shard_index: this shard.
        what: "gradient", "value" or "parameter", for messages.
        sparse_ok: accept top-k sparse partitions (default: for gradients only).
    """

    def __init__(self, plan: Plan, shard_index: int, what: str, sparse_ok: bool | None = None) -> None:
        self.plan, self.shard_index = plan, shard_index
        self.owned: Sequence[PartitionSlice] = plan.owned_by(shard_index)
        self.index = plan.index_of(shard_index)
        self.dtypes = plan.dtypes
        self.what = what
        self.sparse_ok = what == "gradient" if sparse_ok is None else sparse_ok
        self.seen = bytearray(len(self.owned))
        self.budget = plan.request_bytes(shard_index, self.sparse_ok)
        """Most bytes a well-formed request to this shard takes (see :meth:`Plan.request_bytes`)."""
        self.received = 0
        self.values: list[torch.Tensor | None] = [None] * len(self.owned)
        """Per owned partition (plan order), its checked values in the parameter's dtype; None: not received."""
        self.bound = 0.0
        """The largest magnitude bound of the values received (:attr:`Bounded.max_abs`)."""

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` more of the request (before they are parsed).

        Raises:
            InvalidRequestError: the request exceeds :attr:`budget`.
        """
        self.received += nbytes
        if self.received > self.budget:
            raise InvalidRequestError(
                f"The request carries more than {self.budget} bytes, the most shard {self.shard_index}'s "
                f"{len(self.owned)} partitions take; send each partition once, and nothing else."
            )

    def slot(self, part: WirePartition) -> int:
        """Check ``part``'s slice, dtype and byte counts, and that it was not sent before in this
        request; returns its position among the shard's partitions (plan order).

        Raises:
            UnknownKeyError: a key that is not a parameter, or a slice this shard does not own.
            InvalidRequestError: wrong dtype or byte count, a partition sent twice, sparse values.
        """
        dtypes = self.dtypes
        if part.key not in dtypes:
            names = ", ".join(quote(k, 40) for k in sorted(dtypes)[:8])
            raise UnknownKeyError(
                f"Unknown parameter {quote(part.key)}; this cluster's plan has {names}"
                f"{'…' if len(dtypes) > 8 else ''}. Rebuild the plan from the same model."
            )
        where = f"{part.key}[{part.offset}:{part.offset + part.length}]"
        i = self.index.get((part.key, part.offset))
        if i is None or self.owned[i].length != part.length:
            raise UnknownKeyError(
                f"Partition {where} is not one this shard ({self.shard_index}) owns; compute the plan with "
                "the same num_shards and partition_bytes."
            )
        itemsize = check_dtype(part.key, part.offset, part.dtype, dtypes[part.key])
        if self.seen[i]:
            raise InvalidRequestError(f"Partition {part.key}[{part.offset}:] was sent twice in one request.")
        if len(part.indices):
            if not self.sparse_ok:
                raise InvalidRequestError(f"Only gradients may be sent top-k sparse; send {self.what}s dense.")
            count = len(part.indices) // 4
            if len(part.indices) % 4 or count > part.length or len(part.data) != count * itemsize:
                raise InvalidRequestError(
                    f"Top-k partition {where} carries {len(part.indices)} bytes of uint32 indices and "
                    f"{len(part.data)} bytes of {part.dtype} values: send one value per index, at most "
                    f"{part.length} of them."
                )
        else:
            check_dense_bytes(part.key, part.offset, part.length, part.dtype, len(part.data))
        self.seen[i] = 1
        return i

    def add(self, part: WirePartition) -> WirePartition:
        """:meth:`slot`, then read the values (while the rest of the stream is in flight): dense ones
        checked finite (unless ``part.finite``: checked as its record arrived) and widened to the
        parameter's dtype, sparse ones made dense (:func:`densify`). Returns ``part``.

        Raises:
            UnknownKeyError, InvalidRequestError: as :meth:`slot`; NaN or infinity; a bad sparse partition.
        """
        i = self.slot(part)
        param_dtype = self.dtypes[part.key]
        if len(part.indices):
            self.values[i] = densify(part, torch_dtype(param_dtype), self.what)
            self.bound = math.inf
            return part
        tensor = decode(part.data, part.dtype, part.length)
        if part.finite:
            bound = part.bound
        else:
            bound = check_finite(
                tensor, f"{self.what.capitalize()} {part.key}[{part.offset}:{part.offset + part.length}]"
            )
        if bound > self.bound:
            self.bound = bound
        # a narrower wire dtype is widened here, so sums and optimizer steps run in the parameter's dtype
        self.values[i] = tensor if part.dtype == param_dtype else tensor.to(torch_dtype(param_dtype))
        return part

    def matched(self, expected: Sequence[int] | None = None) -> Bounded:
        """The request's values, once every partition is in: see :func:`match_partitions`.

        Raises:
            InvalidRequestError: a partition missing, or one outside ``expected``.
        """
        owned, seen = self.owned, self.seen
        if expected is None:
            if all(seen):
                return Bounded(self.values, self.bound)  # type: ignore[arg-type]  # every one received
            missing = self.missing()
            raise InvalidRequestError(
                f"The request misses {len(missing)} of this shard's {len(owned)} partitions "
                f"({', '.join(missing[:4])}{'…' if len(missing) > 4 else ''}); "
                f"send every partition the plan gives shard {self.shard_index}."
            )
        wanted = set(expected)
        for i, p in enumerate(owned):
            if seen[i] and i not in wanted:
                raise InvalidRequestError(
                    f"Partition {p.key}[{p.offset}:] is not in the fragment this outer round carries; send only the "
                    "partitions of fragment (round mod --fragments) (ps_common.fragments). Nothing was applied."
                )
        missing = [f"{owned[i].key}[{owned[i].offset}:]" for i in sorted(wanted) if not seen[i]]
        if missing:
            raise InvalidRequestError(
                f"The request misses {len(missing)} of the {len(wanted)} partitions of shard {self.shard_index} in "
                f"the fragment this outer round carries ({', '.join(missing[:4])}{'…' if len(missing) > 4 else ''}); "
                "send every partition of fragment (round mod --fragments) (ps_common.fragments)."
            )
        return Bounded((t for t in self.values if t is not None), self.bound)

    def missing(self) -> list[str]:
        """The shard's partitions not received yet, as ``key[offset:]``."""
        return [f"{p.key}[{p.offset}:]" for p, seen in zip(self.owned, self.seen, strict=True) if not seen]


class Bounded(list[torch.Tensor]):
    """Tensors with ``max_abs``, an upper bound of every absolute value in them that the checks
    found on the way (``inf``: unknown), so an optimizer step need not read them again to prove
    itself finite (:meth:`~ps_server.shard.store.ParameterStore.apply`)."""

    def __init__(self, tensors: Iterable[torch.Tensor], max_abs: float) -> None:
        super().__init__(tensors)
        self.max_abs = max_abs


def max_abs_of(tensors: Sequence[torch.Tensor]) -> float:
    """The bound a :class:`Bounded` carries; ``inf`` for any other sequence."""
    return tensors.max_abs if isinstance(tensors, Bounded) else math.inf


class Admitted(list[WirePartition]):
    """A request's partitions as its :class:`Intake` admitted them (a request stream read by
    ``ps_server.service.request_streams``), with that intake: :func:`match_partitions` takes its
    values as they were read and checked, and reads none of them again."""

    def __init__(self, intake: Intake, parts: Iterable[WirePartition]) -> None:
        super().__init__(parts)
        self.intake = intake


def match_partitions(
    plan: Plan,
    shard_index: int,
    received: Iterable[WirePartition],
    what: str,
    sparse_ok: bool | None = None,
    expected: Sequence[int] | None = None,
) -> Bounded:
    """Check that ``received`` is exactly the shard's partitions (or ``expected``'s), each well-formed and finite.

    Args:
        plan: the cluster's plan.
        shard_index: this shard.
        received: partitions in any order; an :class:`Admitted` request's are taken as its intake
            read them (not read again).
        what: "gradient", "value" or "parameter", for messages.
        sparse_ok: accept top-k sparse partitions (default: for gradients only).
        expected: the indices (into the shard's partitions, ascending) the request must carry, and no
            others (a diloco round of one fragment, :func:`ps_common.fragments.owned_slots`); None: all.

    Returns:
        1-D tensors of the parameters' dtypes, one per expected partition in plan order: read-only
        views of the received bytes when the wire dtype is the parameter's, widened copies of
        narrower wire dtypes, dense copies of sparse partitions; with the largest magnitude bound
        their finiteness checks found (``inf`` with a sparse one).

    Raises:
        UnknownKeyError: a key that is not a parameter, or a slice this shard does not own.
        InvalidRequestError: wrong dtype or byte length, a partition sent twice, a missing
            partition, or NaN/infinity.
    """
    intake = received.intake if isinstance(received, Admitted) else None
    if intake is None or intake.plan is not plan or intake.what != what or sparse_ok is not None:
        intake = Intake(plan, shard_index, what, sparse_ok)
        for part in received:
            intake.add(part)
    return intake.matched(expected)
