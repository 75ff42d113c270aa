"""Admission, expiry and the LRU bound of embedding tables, in the pure table store (ps_server.tables:
admission, lifetime, table, store)."""

from __future__ import annotations

import pytest
import torch

from ps_common.errors import InvalidRequestError, TableFullError
from ps_common.tables import RowOptimizerSpec, TableSpec, initial_rows
from ps_server.policy import POLICIES
from ps_server.tables.admission import AdmissionFilter
from ps_server.tables.row_read import RowRequest
from ps_server.tables.store import TableStore
from ps_server.tables.table import RowGrads, table_row_bytes

ADAGRAD = RowOptimizerSpec("adagrad", {"lr": 0.5})
ASYNC = POLICIES["async"]
NAME = "emb.weight"


def spec(**kw) -> TableSpec:
    return TableSpec(NAME, 10**9, 4, ADAGRAD, **kw)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def store_of(s: TableSpec, clock: Clock | None = None) -> TableStore:
    store = TableStore(0, 1, max_rows=10**6, clock=clock or Clock())
    store.declare([s])
    return store


def push(store: TableStore, ids: list[int], clock: int) -> None:
    t = torch.tensor(ids, dtype=torch.int64)
    store.push(ASYNC, 0, 1, clock, {NAME: RowGrads(t, torch.ones(len(ids), 4))})


def initial(ids: list[int]) -> torch.Tensor:
    return initial_rows(NAME, 0, 1.0, torch.tensor(ids), 4)


def test_a_row_is_stored_at_its_kth_push_and_reads_initial_until_then() -> None:
    store = store_of(spec(admit_after=3))
    table = store.table(NAME)
    push(store, [5, 7], 0)
    push(store, [5], 1)
    assert table.rows == 0 and torch.equal(store.pull([(NAME, torch.tensor([5, 7]))])[0], initial([5, 7]))
    push(store, [5, 7], 2)  # 5's third push: stored with this step applied; 7's second: dropped
    assert table.rows == 1 and table.life.admitted == 1
    rows = store.pull([(NAME, torch.tensor([5, 7]))])[0]
    assert not torch.equal(rows[0], initial([5])[0]) and torch.equal(rows[1], initial([7])[0])
    assert table.step == 3  # every push is a step, admitted rows or not


def test_the_filter_never_admits_late_under_collisions() -> None:
    f = AdmissionFilter(64 * 1024, generations=1)
    ids = torch.arange(200_000, dtype=torch.int64)  # far more ids than cells: many collisions
    f.add(ids)
    f.add(ids[:1000])
    est = f.estimate(ids)
    assert bool((est[:1000] >= 2).all()) and bool((est >= 1).all())
    assert f.num_bytes <= 64 * 1024


def test_rows_untouched_for_t_rounds_expire_and_come_back_through_admission() -> None:
    store = store_of(spec(admit_after=2, expire_after_rounds=4))
    table = store.table(NAME)
    push(store, [1, 2], 0)
    push(store, [1, 2], 1)
    assert table.rows == 2
    for c in range(2, 6):  # row 2 kept alive, row 1 not pushed for 4 steps
        push(store, [2, 100 + c], c)
    assert store.expire() == 1 and table.rows == 1 and table.life.evicted["expired"] == 1
    assert torch.equal(store.pull([(NAME, torch.tensor([1]))])[0], initial([1]))
    push(store, [1], 6)  # the filter forgot row 1's pushes (older than the window): admission again
    assert table.rows == 1
    push(store, [1], 7)
    assert table.rows == 2


def test_rows_untouched_for_s_seconds_expire_on_the_timer() -> None:
    clock = Clock()
    store = store_of(spec(expire_after_seconds=30.0), clock)
    push(store, [1, 2, 3], 0)
    clock.t += 20
    push(store, [3], 1)
    clock.t += 15
    assert store.expire() == 2 and store.table(NAME).rows == 1


def test_lru_keeps_the_bytes_within_max_bytes_and_evicts_the_least_recently_pushed() -> None:
    row = table_row_bytes(spec())
    store = store_of(spec(max_bytes=100 * row, on_full="evict_lru"))
    table = store.table(NAME)
    push(store, list(range(100)), 0)
    push(store, list(range(50)), 1)  # 50..99 are now the least recently pushed
    for c in range(2, 4):
        push(store, list(range(1000 * c, 1000 * c + 20)), c)
    assert 40 <= table.life.evicted["lru"] <= 50 and table.rows <= 100
    held = table.index.lookup(torch.arange(50)) >= 0
    assert bool(held.all())  # pushed more recently than any evicted row: still held
    for c in range(4, 40):
        push(store, list(range(1000 * c, 1000 * c + 30)), c)
        assert table.num_bytes <= 100 * row and table.rows <= 100
    with pytest.raises(TableFullError):  # one push of more rows than the bound
        push(store, list(range(10**6, 10**6 + 101)), 40)


def test_an_open_read_answers_its_version_across_an_eviction() -> None:
    row = table_row_bytes(spec())
    store = store_of(spec(max_bytes=64 * row, on_full="evict_lru"))
    push(store, list(range(64)), 0)
    before = store.pull([(NAME, torch.arange(64))])[0]
    read = store.open_read([RowRequest.of(NAME, torch.arange(64), 1)])
    push(store, list(range(100, 164)), 1)  # evicts every row the read asks for, reuses their slots
    while read.step():
        pass
    read.close()
    assert torch.equal(read.result()[0], before)


def test_admission_counts_and_stamps_survive_a_checkpoint() -> None:
    store = store_of(spec(admit_after=2, expire_after_rounds=10))
    push(store, [1, 2], 0)
    push(store, [1], 1)
    other = TableStore(0, 1, max_rows=10**6)
    other.restore(store.export())
    t = other.table(NAME)
    assert t.rows == 1 and t.spec.admit_after == 2 and t.life.admitted == 1
    push(other, [2], 2)  # its first push was counted before the checkpoint
    assert t.rows == 2
    assert int(t.life.step_stamp[0]) == 2


@pytest.mark.parametrize(
    "kw",
    [
        {"admit_after": 256},
        {"admit_after": -1},
        {"expire_after_rounds": -1},
        {"expire_after_seconds": float("nan")},
        {"max_bytes": -5},
        {"on_full": "evict_random"},
        {"on_full": "evict_lru"},  # without max_bytes
    ],
)
def test_bad_lifetime_settings_are_refused(kw: dict) -> None:
    with pytest.raises(InvalidRequestError):
        spec(**kw)


def test_a_max_bytes_below_one_row_declares_nothing() -> None:
    store = TableStore(0, 1, max_rows=10)
    with pytest.raises(InvalidRequestError, match="max_bytes"):
        store.declare([spec(max_bytes=10)])
    assert store.tables == {}
