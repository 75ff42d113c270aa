"""Tensor codecs: torch tensors <-> raw little-endian bytes of one partition.

:data:`DTYPES` is the one table of wire dtypes: name (``float32``, ``float16``, ``bfloat16``,
``float64``), torch dtype, ``ps.v1.Dtype`` value and bytes per element. Decoding wraps the received
``bytes`` without a copy (``torch.frombuffer``) and the caller copies it once into its destination.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from ps_common.errors import InvalidRequestError
from ps_proto.v1 import ps_pb2

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("grpc-ps sends raw little-endian tensors and needs a little-endian host.")


@dataclass(frozen=True)
class WireDtype:
    """A dtype that travels: its wire name, torch dtype, ``ps.v1.Dtype`` value and bytes per element."""

    name: str
    torch: torch.dtype
    proto: int
    itemsize: int


DTYPES: dict[str, WireDtype] = {
    d.name: d
    for d in (
        WireDtype("float32", torch.float32, ps_pb2.DTYPE_FLOAT32, 4),
        WireDtype("float16", torch.float16, ps_pb2.DTYPE_FLOAT16, 2),
        WireDtype("bfloat16", torch.bfloat16, ps_pb2.DTYPE_BFLOAT16, 2),
        WireDtype("float64", torch.float64, ps_pb2.DTYPE_FLOAT64, 8),
    )
}
"""The one table of wire dtypes, by name (the proto enum's order)."""

_BY_TORCH = {d.torch: d for d in DTYPES.values()}
_BY_PROTO = {d.proto: d for d in DTYPES.values()}


def wire_dtype(name: str) -> WireDtype:
    """The row of a wire dtype name.

    Raises:
        InvalidRequestError: unsupported name.
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidRequestError(f"Unsupported dtype {name!r}; expected one of {', '.join(sorted(DTYPES))}.") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name.

    Raises:
        InvalidRequestError: unsupported name.
    """
    return wire_dtype(name).torch


def itemsize(name: str) -> int:
    """Bytes per element of a wire dtype name.

    Raises:
        InvalidRequestError: unsupported name.
    """
    return wire_dtype(name).itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype.

    Raises:
        InvalidRequestError: not a floating dtype grpc-ps transports.
    """
    try:
        return _BY_TORCH[dtype].name
    except KeyError:
        raise InvalidRequestError(
            f"Parameters of dtype {dtype} are not supported; use one of {', '.join(sorted(DTYPES))}."
        ) from None


def dtype_from_proto(value: int) -> str:
    """The wire name of a ``ps.v1.Dtype`` value.

    Raises:
        InvalidRequestError: DTYPE_UNSPECIFIED or unknown.
    """
    try:
        return _BY_PROTO[value].name
    except KeyError:
        raise InvalidRequestError(
            f"Partition dtype {value} is unspecified or unknown; set it to one of "
            f"{', '.join(ps_pb2.Dtype.Name(v) for v in _BY_PROTO)}."
        ) from None


def dtype_to_proto(name: str) -> int:
    """The ``ps.v1.Dtype`` value of a wire dtype name.

    Raises:
        InvalidRequestError: unsupported name.
    """
    return wire_dtype(name).proto


def wire_dtype_allowed(wire: str, param: str) -> bool:
    """Whether values of a ``param``-dtype parameter may travel as ``wire``: the same dtype, or a
    narrower float (float16/bfloat16 for float32 or float64, float32 for float64) that the
    receiver widens (wire compression)."""
    return wire == param or torch_dtype(wire).itemsize < torch_dtype(param).itemsize


def decode(data: bytes | memoryview, name: str, length: int) -> torch.Tensor:
    """A read-only 1-D tensor viewing ``data`` (no copy).

    Args:
        data: ``length * itemsize(name)`` little-endian bytes (``bytes`` or a byte memoryview).
        name: wire dtype name.
        length: number of elements.

    Returns:
        Shape ``[length]`` tensor of dtype ``torch_dtype(name)``; copy it before writing.

    Raises:
        InvalidRequestError: byte count does not match ``length`` and the dtype.
    """
    dtype = torch_dtype(name)
    expected = length * dtype.itemsize
    if len(data) != expected:
        raise InvalidRequestError(
            f"Partition carries {len(data)} bytes but {length} elements of {name} need {expected}; "
            "send exactly the slice the plan names."
        )
    if length == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, count=length)


def _spend_read_only_warning() -> None:
    """``torch.frombuffer`` over ``bytes`` warns that the buffer is not writable, once per process
    (``TORCH_WARN_ONCE``; every call when ``torch.set_warn_always(True)``). :func:`decode` never
    writes through its view, so the one warning is spent here under a local filter: the process's
    warnings filters stay as they were, and decoding pays nothing per call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        torch.frombuffer(bytes(4), dtype=torch.float32)


_spend_read_only_warning()


def check_finite(t: torch.Tensor, what: str) -> float:
    """Raise if ``t`` holds NaN or infinity; return an upper bound of its absolute values when the
    check found one for free (float32/float64: the L2 norm ``sqrt(t . t)``), else ``inf``.

    float32 and float64 vectors: one BLAS dot product ``t . t`` first (a read-only SIMD pass with no
    temporary: about 10x cheaper than ``numpy.isfinite(a).all()`` on a 4 MiB partition, measured by
    bench/wire_costs.py), which is finite only if every element is; only when it is not (a NaN or an
    infinity, or squares of finite values beyond the dtype's range) does the exact
    ``numpy.isfinite`` check decide. float16: ``numpy.isfinite``; bfloat16: its exponent bits.

    Raises:
        InvalidRequestError: non-finite values, naming ``what``.
    """
    bound = math.inf
    if t.dtype in (torch.float32, torch.float64) and t.dim() == 1 and t.numel():
        square = float(torch.dot(t, t))
        if math.isfinite(square):
            finite, bound = True, math.sqrt(square)
        else:
            finite = bool(np.isfinite(t.numpy()).all())
    elif t.dtype in (torch.float32, torch.float64, torch.float16):
        finite = bool(np.isfinite(t.numpy()).all())
    elif t.dtype == torch.bfloat16 and t.is_contiguous():  # exponent bits all ones: inf or NaN
        bits = t.view(torch.int16).numpy()
        finite = not bool(np.any((bits & 0x7F80) == 0x7F80))
    else:
        finite = bool(torch.isfinite(t).all())
    if not finite:
        raise InvalidRequestError(
            f"{what} contains NaN or infinity; lower the learning rate or clip gradients, then push again."
        )
    return bound
