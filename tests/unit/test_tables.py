"""Embedding tables' pure core: partitioning, lazy deterministic rows, the cap, coalescing, the
table store's sync rounds and async pushes, checkpoints (ps_common.tables, ps_server.tables.table,
ps_server.tables.store)."""

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
from ps_server.policy import POLICIES
from ps_server.tables.store import TableStore
from ps_server.tables.table import RowGrads, Table, coalesce

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
            assert store.push(POLICIES["sync"], rank, 1, 0, grads[rank]) == (0, False)
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
    store.push(POLICIES["sync"], 0, 1, 0, g)
    assert store.push(POLICIES["sync"], 0, 1, 0, g) == (0, True)
    with pytest.raises(FutureRoundError):
        store.push(POLICIES["sync"], 1, 1, 1, g)
    nan = {"emb.weight": RowGrads(torch.tensor([1]), torch.full((1, 4), float("nan")))}
    with pytest.raises(InvalidRequestError, match="NaN"):
        store.push(POLICIES["sync"], 1, 1, 0, nan)
    with pytest.raises(PreconditionError, match="easgd"):
        store.push(POLICIES["easgd"], 1, 1, 0, g)
    assert list(store.held) == [0] and store.version == 0


def test_async_applies_at_once_and_once() -> None:
    store = _store()
    g = {"bag.weight": RowGrads(torch.tensor([7, 7]), torch.ones(2, 2))}
    before = store.pull([("bag.weight", torch.tensor([7]))])[0]
    assert store.push(POLICIES["async"], 0, 1, 0, g) == (1, False)
    assert store.push(POLICIES["async"], 0, 1, 0, g) == (1, True)
    after = store.pull([("bag.weight", torch.tensor([7]))])[0]
    assert torch.allclose(after, before - 0.5 * 2)  # duplicates summed
    assert store.tables["emb.weight"].step == 1  # every table counts the step


def test_export_restore_round_trip() -> None:
    store = _store()
    store.push(POLICIES["async"], 0, 1, 0, {"emb.weight": RowGrads(torch.tensor([3, 9]), torch.ones(2, 4))})
    saved = store.export()
    other = TableStore(0, 1, max_rows=100)
    other.restore(saved)
    ids = torch.arange(20)
    assert torch.equal(other.pull([("emb.weight", ids)])[0], store.pull([("emb.weight", ids)])[0])
    assert other.version == 1 and other.tables["emb.weight"].rows == 2
    assert other.push(POLICIES["async"], 0, 1, 0, {}) == (1, True)  # the high-water mark survives


# ----------------------------------------------------------------- bounded in bytes
ADAM = RowOptimizerSpec("adam", {"lr": 0.01})


def test_one_row_of_a_wide_adam_table_allocates_one_row_not_a_thousand() -> None:
    t = Table(spec(dim=4096, optimizer=ADAM), 0, 1, max_rows=10**6)
    t.apply(torch.tensor([5]), torch.ones(1, 4096))
    assert t.capacity == 1 and t.num_bytes == t.bytes_per_row  # values and two moments of one row
    assert t.bytes_per_row == 4096 * 4 * 3 + 24
    for k in range(2, 6):  # then growth in proportion: at most double what is held
        t.apply(torch.tensor([100 + k]), torch.ones(1, 4096))
        assert t.rows == k and k <= t.capacity <= 2 * k


def test_growth_is_capped_in_bytes_beyond_the_doubling() -> None:
    t = Table(spec(dim=4), 0, 1, max_rows=10**9)
    t.apply(torch.arange(100_000), torch.ones(100_000, 4))
    assert t.capacity == 100_000  # exactly what was asked from empty
    t.apply(torch.tensor([100_001]), torch.ones(1, 4))
    assert t.capacity == 200_000  # doubling: 100_000 * 40 bytes is below the 64 MiB slack
    assert t.grown_capacity(10**7, 10**9) < 2 * 10**7  # large: slack = half the capacity or 64 MiB


def test_the_byte_budget_refuses_before_allocating_and_changes_nothing() -> None:
    row = 4 * 4 * 3 + 24  # dim 4, adam
    store = TableStore(0, 1, max_rows=10**6, max_bytes=10 * row)
    store.declare([spec(optimizer=ADAM)])
    store.push(POLICIES["async"], 0, 1, 0, {"emb.weight": RowGrads(torch.arange(8), torch.ones(8, 4))})
    saved = store.export()
    with pytest.raises(TableFullError, match="--max-table-bytes"):
        store.push(POLICIES["async"], 0, 1, 1, {"emb.weight": RowGrads(torch.arange(8, 11), torch.ones(3, 4))})
    after = store.export()
    assert after["version"] == saved["version"] and torch.equal(after["tables"][0]["ids"], saved["tables"][0]["ids"])
    assert store.tables["emb.weight"].capacity == 8
    store.push(
        POLICIES["async"], 0, 1, 2, {"emb.weight": RowGrads(torch.arange(8, 10), torch.ones(2, 4))}
    )  # fits exactly
    t = store.tables["emb.weight"]
    assert t.rows == 10 and store.num_bytes <= store.max_bytes  # the doubling stopped at the budget


def test_sync_rounds_count_the_open_rounds_rows_against_the_budget() -> None:
    row = 4 * 4 + 24  # dim 4, sgd without momentum
    store = TableStore(0, 1, max_rows=10**6, max_bytes=6 * row)
    store.declare([spec()])
    store.push(POLICIES["sync"], 0, 1, 0, {"emb.weight": RowGrads(torch.arange(4), torch.ones(4, 4))})
    with pytest.raises(TableFullError, match="--max-table-bytes"):  # 4 held in the round + 3 new
        store.push(POLICIES["sync"], 1, 1, 0, {"emb.weight": RowGrads(torch.arange(10, 13), torch.ones(3, 4))})
    store.push(POLICIES["sync"], 1, 1, 0, {"emb.weight": RowGrads(torch.arange(2, 6), torch.ones(4, 4))})  # 6 rows
    assert store.close_round_if_complete([0, 1]) and store.tables["emb.weight"].rows == 6


def test_a_table_whose_one_row_exceeds_the_budget_is_refused_at_declaration() -> None:
    store = TableStore(0, 1, max_rows=10**6, max_bytes=65536 * 4 * 3)  # less than one adam row of dim 65536
    with pytest.raises(TableFullError, match="--max-table-bytes"):
        store.declare([spec(dim=65536, optimizer=ADAM)])
    assert not store.tables
    assert store.declare([spec(dim=65536)])  # sgd: one row fits


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 1e308},
        {"lr": 1e39},
        {"lr": 0.1, "eps": 1e300},
        {"lr": 1e20, "weight_decay": 1e20},  # lr * weight_decay beyond float32
    ],
)
def test_row_optimizer_arguments_are_checked_as_a_dense_optimizers(kwargs: dict) -> None:
    name = "adam" if "eps" in kwargs else "sgd"
    with pytest.raises(InvalidRequestError, match="float32"):
        RowOptimizerSpec(name, kwargs)
    RowOptimizerSpec("sgd", {"lr": 1e30})  # large but within float32 stays allowed


def test_vectorized_rows_equal_the_per_id_reference() -> None:
    """Pushes and pulls of random ids against a per-id reference (a dict of rows stepped one by
    one with the same float ops): bitwise equal, initial rows included."""
    g = torch.Generator().manual_seed(3)
    t = Table(spec(num_rows=10**12), 0, 1, max_rows=10**6)
    reference: dict[int, torch.Tensor] = {}
    for _ in range(20):
        ids = torch.unique(torch.randint(0, 10**12 if _ % 3 else 50, (64,), generator=g))
        grads = torch.randn(ids.numel(), 4, generator=g)
        t.apply(ids, grads)
        for i, row in zip(ids.tolist(), grads, strict=True):
            old = reference.get(i, initial_rows("emb.weight", 0, 1.0, torch.tensor([i]), 4)[0])
            reference[i] = old.clone().add_(row, alpha=-0.5)
    asked = torch.cat([torch.tensor(list(reference)), torch.randint(0, 10**12, (100,), generator=g)])
    asked = asked[torch.randperm(asked.numel(), generator=g)]
    expected = torch.stack(
        [reference.get(i, initial_rows("emb.weight", 0, 1.0, torch.tensor([i]), 4)[0]) for i in asked.tolist()]
    )
    assert torch.equal(t.read(asked), expected)
    store = TableStore(0, 1, max_rows=10**6)
    store.tables = {"emb.weight": t}
    assert torch.equal(store.pull([("emb.weight", asked)])[0], expected)
