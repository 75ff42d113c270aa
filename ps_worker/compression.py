"""Gradient compression for pushes: top-k sparsification with error feedback.

Top-k with error feedback (memory) follows Stich, Cordonnier and Jaggi, "Sparsified SGD with
Memory", NeurIPS 2018, Algorithm 1: each worker keeps the part of its gradients it has not sent
yet, ``m``; at every push it sends ``top_k(m + g)`` — the k entries of largest magnitude — and keeps
``m ← m + g − sent``. Nothing is dropped, only delayed, which is what keeps SGD converging at the
rate of the uncompressed method (their Theorem 2.4) while each push carries k values and k indices
instead of n values. The shard runs the optimizer, so the learning rate is applied there, to the
sent gradient (EF-SGD of Karimireddy et al. 2019, the same algorithm with η moved to the server).
"""

from __future__ import annotations

import math

import torch


class TopK:
    """Top-k sparsification with error feedback, one memory per partition.

    Args:
        ratio: fraction of each partition's elements sent per push, in (0, 1].

    Raises:
        ValueError: ``ratio`` outside (0, 1].
    """

    def __init__(self, ratio: float) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}.")
        self.ratio = ratio
        self.memory: dict[tuple[str, int], torch.Tensor] = {}

    def k(self, n: int) -> int:
        """Elements sent of a partition of ``n`` elements: ``ceil(ratio * n)``, at least 1."""
        return min(n, max(1, math.ceil(self.ratio * n)))

    @torch.no_grad()
    def compress(
        self, slot: tuple[str, int], grad: torch.Tensor, wire_dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Select what to send of ``grad`` and update the memory of ``slot``.

        Args:
            slot: (parameter key, partition offset): whose memory this is.
            grad: shape ``[n]`` gradient slice on the CPU (float32/float64/float16/bfloat16).
            wire_dtype: the values are sent in this dtype (None: ``grad.dtype``); what rounding
                takes away stays in the memory too.

        Returns:
            (indices, values): shape ``[k]`` int32 indices into the slice, ascending, and shape
            ``[k]`` values at them in ``wire_dtype``.
        """
        memory = self.memory.get(slot)
        acc = grad.to(torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype, copy=True)
        if memory is not None:
            acc += memory
        k = self.k(acc.numel())
        idx = torch.topk(acc.abs(), k, sorted=False).indices.sort().values
        values = acc[idx].to(wire_dtype or grad.dtype)
        acc.index_put_((idx,), values.to(acc.dtype).neg(), accumulate=True)
        self.memory[slot] = acc
        return idx.to(torch.int32), values
