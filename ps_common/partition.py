"""One partition as it arrives on the wire, before any check."""

from __future__ import annotations

import math
from dataclasses import dataclass


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
    """Already checked to hold no NaN or infinity, as its record arrived on a data connection
    (overlapping the rest of the frame); the shard's ``Intake`` then skips that check."""
    bound: float = math.inf
    """An upper bound of its values' magnitudes, found by the finiteness check (the L2 norm of a
    float32 partition); ``inf`` when unknown. Lets the optimizer step skip its own read."""
