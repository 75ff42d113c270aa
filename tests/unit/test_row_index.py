"""RowIndex (ps_server.tables.row_index): the vectorized id -> slot map equals a dict, across merges."""

from __future__ import annotations

import pytest
import torch

from ps_server.tables import row_index
from ps_server.tables.row_index import RowIndex


@pytest.mark.parametrize("min_delta", [1, 4, 65536])
def test_lookup_equals_a_dict_through_adds_and_merges(monkeypatch, min_delta: int) -> None:
    monkeypatch.setattr(row_index, "MIN_DELTA", min_delta)
    g = torch.Generator().manual_seed(0)
    index, reference, n = RowIndex(), {}, 0
    for _ in range(40):
        candidates = torch.unique(
            torch.randint(-(2**62), 2**62, (int(torch.randint(1, 50, (1,), generator=g)),), generator=g)
        )
        new = torch.tensor([i for i in candidates.tolist() if i not in reference], dtype=torch.int64)
        new = new[torch.randperm(new.numel(), generator=g)]  # any order
        slots = torch.arange(n, n + new.numel())
        index.add(new, slots)
        reference.update(zip(new.tolist(), slots.tolist(), strict=True))
        n += new.numel()
        held = torch.tensor(list(reference), dtype=torch.int64)
        asked = torch.cat([held, torch.randint(-(2**62), 2**62, (30,), generator=g), held[:3]])
        expected = torch.tensor([reference.get(i, -1) for i in asked.tolist()], dtype=torch.int64)
        assert torch.equal(index.lookup(asked), expected)
        assert len(index) == len(reference)
    rebuilt = RowIndex.of(torch.tensor(list(reference), dtype=torch.int64))
    assert torch.equal(rebuilt.lookup(asked), expected)


def test_empty_index_and_empty_lookups() -> None:
    index = RowIndex()
    assert torch.equal(index.lookup(torch.tensor([1, 2])), torch.tensor([-1, -1]))
    assert index.lookup(torch.empty(0, dtype=torch.int64)).numel() == 0
    index.add(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    assert len(index) == 0
