"""Tensors as the raw bytes a partition carries, for tests that build messages by hand (the
product writes them with ``ps_common.frames``, one copy from the tensor into the message)."""

from __future__ import annotations

import torch


def encode(flat: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a 1-D contiguous CPU tensor (one copy).

    Args:
        flat: shape ``[n]``, any dtype of ``ps_common.codec.DTYPES``, on the CPU.

    Raises:
        ValueError: not 1-D, or not on the CPU.
    """
    if flat.device.type != "cpu" or flat.dim() != 1:
        raise ValueError("encode() takes a 1-D CPU tensor; stage device tensors through host memory.")
    return flat.contiguous().view(torch.uint8).numpy().tobytes()
