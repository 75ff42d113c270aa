"""Sync (BSP) rounds: rank-ordered sums, exact rounds, order-independent results."""

from __future__ import annotations

import itertools

import pytest
import torch

from ps_common.errors import PreconditionError, StalePushError
from ps_server.core.partitions import Bounded
from ps_server.policy.sync import SyncRounds, aggregate


def grads(seed: int, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * 1e3 for _ in range(2)]


def test_aggregate_is_the_mean_summed_in_rank_order() -> None:
    by_rank = {2: grads(2), 0: grads(0), 1: grads(1)}
    out = aggregate(by_rank)
    for i in range(2):
        expected = ((by_rank[0][i] + by_rank[1][i]) + by_rank[2][i]) / 3
        assert torch.equal(out[i], expected)


def test_aggregate_does_not_modify_inputs() -> None:
    g0 = grads(0)
    before = [t.clone() for t in g0]
    aggregate({0: g0, 1: grads(1)})
    assert all(torch.equal(a, b) for a, b in zip(g0, before, strict=True))


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_arrival_order_never_changes_the_bits(order: tuple[int, ...]) -> None:
    reference = aggregate({r: grads(r) for r in range(4)})
    rounds = SyncRounds()
    result = None
    for r in order:
        rounds.add(r, 0, grads(r))
        result = rounds.close_if_complete(range(4))
    assert result is not None and rounds.round == 1
    assert all(torch.equal(a, b) for a, b in zip(result, reference, strict=True))


def test_round_waits_for_every_expected_rank() -> None:
    rounds = SyncRounds()
    rounds.add(0, 0, grads(0))
    assert rounds.close_if_complete([0, 1]) is None
    assert rounds.waiting_for([0, 1]) == [1]
    rounds.add(1, 0, grads(1))
    assert rounds.close_if_complete([0, 1]) is not None
    assert rounds.round == 1 and not rounds.pending


def test_round_closes_without_a_rank_that_is_no_longer_expected() -> None:
    rounds = SyncRounds()
    rounds.add(0, 0, grads(0))
    out = rounds.close_if_complete([0])  # rank 1 left or was evicted
    assert out is not None and all(torch.equal(a, b) for a, b in zip(out, grads(0), strict=True))


def test_empty_round_never_closes() -> None:
    assert SyncRounds().close_if_complete([]) is None


def test_stale_future_and_repeated_pushes_are_refused() -> None:
    rounds = SyncRounds(round=5)
    with pytest.raises(StalePushError, match="closed"):
        rounds.add(0, 4, grads(0))
    with pytest.raises(PreconditionError, match="pull version 6"):
        rounds.add(0, 6, grads(0))
    rounds.add(0, 5, grads(0))
    with pytest.raises(PreconditionError, match="already pushed"):
        rounds.add(0, 5, grads(0))


def test_aggregate_carries_the_largest_of_the_ranks_bounds() -> None:
    a, b = Bounded([torch.tensor([1.0, -2.0])], 2.5), Bounded([torch.tensor([-6.0, 0.0])], 6.0)
    mean = aggregate({0: a, 1: b})
    assert mean.max_abs == 6.0 >= float(mean[0].abs().max())
    assert aggregate({3: a}).max_abs == 2.5
    assert aggregate({0: a, 1: [torch.tensor([0.0, 0.0])]}).max_abs == float("inf")  # one rank unknown
