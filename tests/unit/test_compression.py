"""Top-k with error feedback (Stich et al. 2018, Algorithm 1): nothing is lost, only delayed."""

from __future__ import annotations

import pytest
import torch

from ps_worker.compression import TopK


def test_sent_plus_memory_is_every_gradient_so_far() -> None:
    gen = torch.Generator().manual_seed(0)
    topk = TopK(0.1)
    sent_total = torch.zeros(1000, dtype=torch.float64)
    grads_total = torch.zeros(1000, dtype=torch.float64)
    for _ in range(50):
        g = torch.randn(1000, generator=gen, dtype=torch.float64)
        idx, values = topk.compress(("w", 0), g)
        assert idx.dtype == torch.int32 and idx.numel() == values.numel() == 100
        assert bool((idx[1:] > idx[:-1]).all())  # ascending, no repeats
        sent_total[idx.long()] += values
        grads_total += g
    torch.testing.assert_close(sent_total + topk.memory[("w", 0)], grads_total, rtol=0, atol=1e-12)


def test_the_largest_entries_of_gradient_plus_memory_are_sent() -> None:
    topk = TopK(0.5)
    idx, values = topk.compress(("b", 0), torch.tensor([0.1, -5.0, 0.2, 3.0]))
    assert idx.tolist() == [1, 3] and values.tolist() == [-5.0, 3.0]
    assert topk.memory[("b", 0)].tolist() == pytest.approx([0.1, 0.0, 0.2, 0.0])
    # the held-back entries grow until they are sent
    idx, values = topk.compress(("b", 0), torch.tensor([0.1, 0.0, 0.3, 0.0]))
    assert idx.tolist() == [0, 2] and values.tolist() == pytest.approx([0.2, 0.5])


def test_rounding_to_the_wire_dtype_stays_in_the_memory() -> None:
    topk = TopK(1.0)
    g = torch.tensor([1.0 + 2**-10, 3.0])  # 1 + 2^-10 is not a bfloat16
    _, values = topk.compress(("w", 0), g, torch.bfloat16)
    assert values.dtype == torch.bfloat16
    torch.testing.assert_close(values.float() + topk.memory[("w", 0)], g, rtol=0, atol=0)


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5])
def test_ratio_must_be_a_fraction(ratio: float) -> None:
    with pytest.raises(ValueError, match="ratio"):
        TopK(ratio)
