"""Embedding tables' pure core: partitioning, lazy deterministic rows, the cap, coalescing, the
table store's sync rounds and async pushes, checkpoints (ps_common.tables, ps_server.tables,
ps_server.table_store)."""

from __future__ import annotations

import pytest
import torch

from ps_common.errors import (
    FutureRoundError,
    InvalidRequestError,
    PlanMismatchError,
    PreconditionError,
    TableFullError,
)
from ps_common.tables import MAX_ROWS, RowOptimizerSpec, TableSpec, initial_rows, shard_of
from ps_server.table_store import TableStore
from ps_server.tables import RowGrads, Table, coalesce

SGD = RowOptimizerSpec("sgd", {"lr": 0.5})


def spec(name: str = "emb.weight", num_rows: int = 1000, dim: int = 4, **kw) -> TableSpec:
    return TableSpec(name, num_rows, dim, kw.pop("optimizer", SGD), **kw)


def test_shard_of_is_a_fixed_function_of_the_id_and_balances() -> None:
    ids = torch.arange(100_000)
    owner = shard_of(ids, 4)
    assert owner.tolist()[:8] == shard_of(ids[:8], 4).tolist()
    counts = torch.bincount(owner, minlength=4)
    assert counts.min() > 24_000 and counts.max() < 26_000
    big = torch.tensor([MAX_ROWS - 1, 2**62, 0])
    assert shard_of(big, 3).tolist() == shard_of(big.clone(), 3).tolist()
    assert ((shard_of(big, 3) >= 0) & (shard_of(big, 3) < 3)).all()


def test_initial_rows_depend_on_name_seed_and_id_only() -> None:
    ids = torch.tensor([0, 5, 2**62 + 7])
    a = initial_rows("t", 1, 1.0, ids, 16)
    assert a.shape == (3, 16) and a.dtype == torch.float32
    assert torch.equal(a[1:2], initial_rows("t", 1, 1.0, torch.tensor([5]), 16))
    assert not torch.equal(a, initial_rows("t", 2, 1.0, ids, 16))
    assert not torch.equal(a, initial_rows("u", 1, 1.0, ids, 16))
    many = initial_rows("t", 0, 0.5, torch.arange(20_000), 8)
    assert abs(float(many.mean())) < 0.01 and abs(float(many.std()) - 0.5) < 0.01


def test_any_shard_count_reads_the_same_rows() -> None:
    ids = torch.arange(0, 3000, 7)
    values = {}
    for num_shards in (1, 2, 3):
        tables = [Table(spec(), k, num_shards, 10_000) for k in range(num_shards)]
        owner = shard_of(ids, num_shards)
        out = torch.empty(ids.numel(), 4)
        for k, t in enumerate(tables):
            out[owner == k] = t.read(ids[owner == k])
        values[num_shards] = out
    assert torch.equal(values[1], values[2]) and torch.equal(values[1], values[3])


def test_coalesce_sums_duplicates_in_a_fixed_order() -> None:
    parts = [
        RowGrads(torch.tensor([3, 1, 3]), torch.tensor([[1.0], [2.0], [4.0]])),
        RowGrads(torch.tensor([1]), torch.tensor([[8.0]])),
    ]
    ids, grads = coalesce(parts, 1)
    assert ids.tolist() == [1, 3] and grads.flatten().tolist() == [10.0, 5.0]


def test_pull_allocates_nothing_push_creates_rows_and_the_cap_refuses() -> None:
    t = Table(spec(), 0, 1, max_rows=3)
    t.read(torch.arange(100))
    assert t.rows == 0
    t.apply(torch.tensor([1, 2]), torch.ones(2, 4))
    assert t.rows == 2
    before = t.read(torch.arange(10))
    with pytest.raises(TableFullError):
        t.apply(torch.tensor([3, 4]), torch.ones(2, 4))
    assert t.rows == 2 and torch.equal(t.read(torch.arange(10)), before)
    t.apply(torch.tensor([2, 3]), torch.ones(2, 4))  # one new row fits
    assert t.rows == 3


def test_ids_out_of_range_or_not_owned_are_refused() -> None:
    t = Table(spec(num_rows=10), 0, 2, max_rows=100)
    with pytest.raises(InvalidRequestError, match="out of table"):
        t.check_ids(torch.tensor([10]))
    with pytest.raises(InvalidRequestError, match="out of table"):
        t.check_ids(torch.tensor([-1]))
    other = torch.arange(10)[shard_of(torch.arange(10), 2) == 1][:1]
    with pytest.raises(InvalidRequestError, match="belongs to shard 1"):
        t.check_ids(other)


def _store(num_shards: int = 1) -> TableStore:
    store = TableStore(0, num_shards, max_rows=100)
    store.declare([spec(), spec("bag.weight", 50, 2)])
    return store


def test_declare_is_first_writer_wins_and_checks_shape() -> None:
    store = _store()
    assert not store.declare([spec(optimizer=RowOptimizerSpec("adagrad", {"lr": 1.0})), spec("bag.weight", 50, 2)])
    assert store.tables["emb.weight"].spec.optimizer == SGD  # rank 0's declaration stays
    with pytest.raises(PlanMismatchError):
        store.declare([spec(dim=5), spec("bag.weight", 50, 2)])
    with pytest.raises(InvalidRequestError):
        TableStore(0, 1, 10).declare([spec(), spec()])
    with pytest.raises(PreconditionError):
        TableStore(0, 1, 10).pull([("emb.weight", torch.tensor([1]))])


def test_sync_round_applies_in_rank_order_whatever_the_arrival_order() -> None:
    grads = {
        0: {"emb.weight": RowGrads(torch.tensor([1, 2]), torch.full((2, 4), 0.1))},
        1: {"emb.weight": RowGrads(torch.tensor([2, 3]), torch.full((2, 4), 0.3))},
    }
    results = []
    for order in ([0, 1], [1, 0]):
        store = _store()
        before = store.pull([("emb.weight", torch.arange(5))])[0]
        for rank in order:
            assert store.push("sync", rank, 1, 0, grads[rank]) == (0, False)
            closed = store.close_round_if_complete([0, 1])
        assert closed and store.version == 1
        after = store.pull([("emb.weight", torch.arange(5))])[0]
        results.append(after)
    assert torch.equal(results[0], results[1])
    assert torch.allclose(after[2], before[2] - 0.5 * (0.1 + 0.3) / 2)
    assert torch.equal(after[0], before[0])


def test_sync_duplicates_future_rounds_and_bad_pushes_change_nothing() -> None:
    store = _store()
    g = {"emb.weight": RowGrads(torch.tensor([1]), torch.ones(1, 4))}
    store.push("sync", 0, 1, 0, g)
    assert store.push("sync", 0, 1, 0, g) == (0, True)
    with pytest.raises(FutureRoundError):
        store.push("sync", 1, 1, 1, g)
    nan = {"emb.weight": RowGrads(torch.tensor([1]), torch.full((1, 4), float("nan")))}
    with pytest.raises(InvalidRequestError, match="NaN"):
        store.push("sync", 1, 1, 0, nan)
    with pytest.raises(PreconditionError, match="easgd"):
        store.push("easgd", 1, 1, 0, g)
    assert list(store.held) == [0] and store.version == 0


def test_async_applies_at_once_and_once() -> None:
    store = _store()
    g = {"bag.weight": RowGrads(torch.tensor([7, 7]), torch.ones(2, 2))}
    before = store.pull([("bag.weight", torch.tensor([7]))])[0]
    assert store.push("async", 0, 1, 0, g) == (1, False)
    assert store.push("async", 0, 1, 0, g) == (1, True)
    after = store.pull([("bag.weight", torch.tensor([7]))])[0]
    assert torch.allclose(after, before - 0.5 * 2)  # duplicates summed
    assert store.tables["emb.weight"].step == 1  # every table counts the step


def test_export_restore_round_trip() -> None:
    store = _store()
    store.push("async", 0, 1, 0, {"emb.weight": RowGrads(torch.tensor([3, 9]), torch.ones(2, 4))})
    saved = store.export()
    other = TableStore(0, 1, max_rows=100)
    other.restore(saved)
    ids = torch.arange(20)
    assert torch.equal(other.pull([("emb.weight", ids)])[0], store.pull([("emb.weight", ids)])[0])
    assert other.version == 1 and other.tables["emb.weight"].rows == 2
    assert other.push("async", 0, 1, 0, {}) == (1, True)  # the high-water mark survives
