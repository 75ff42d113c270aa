"""RowRead (ps_server.tables.row_read): a chunked pull holds the lock one bounded chunk at a time and
still answers one version exactly, whatever pushes apply between its chunks."""

from __future__ import annotations

import pytest
import torch

from ps_common.tables import RowOptimizerSpec, TableSpec, initial_rows
from ps_server.policy import POLICIES
from ps_server.tables import row_read
from ps_server.tables.row_read import RowRequest
from ps_server.tables.store import TableStore
from ps_server.tables.table import READ_CHUNK_BYTES, READ_CHUNK_IDS, RowGrads


def _store(dim: int = 4) -> TableStore:
    store = TableStore(0, 1, max_rows=10**6)
    store.declare([TableSpec("t", 10**9, dim, RowOptimizerSpec("sgd", {"lr": 1.0}), seed=5)])
    return store


def _push(store: TableStore, clock: int, ids: torch.Tensor, value: float = -1.0) -> None:
    store.push(POLICIES["async"], 0, 1, clock, {"t": RowGrads(ids, torch.full((ids.numel(), 4), value))})


def test_each_step_looks_up_at_most_one_chunk(monkeypatch) -> None:
    monkeypatch.setattr(row_read, "READ_CHUNK_IDS", 1000)
    store = _store()
    _push(store, 0, torch.arange(0, 5000, 2))
    sizes: list[int] = []
    index = store.tables["t"].index
    lookup = index.lookup
    monkeypatch.setattr(index, "lookup", lambda ids: sizes.append(ids.numel()) or lookup(ids))
    ids = torch.randperm(4500)
    read = store.open_read([RowRequest.of("t", ids, 1)])
    steps = 1
    while read.step():
        steps += 1
    read.close()
    assert sizes == [1000] * 4 + [500] and steps == 5  # never more than a chunk per hold of the lock
    assert torch.equal(read.result()[0], store.pull([("t", ids)])[0])


def test_wide_rows_are_chunked_by_bytes() -> None:
    store = _store(dim=4)
    read = store.open_read([RowRequest.of("t", torch.arange(10), 1)])
    assert read.parts[0].chunk == min(READ_CHUNK_IDS, READ_CHUNK_BYTES // 16)
    wide = TableStore(0, 1, max_rows=10)
    wide.declare([TableSpec("w", 100, 65536, RowOptimizerSpec("sgd", {"lr": 1.0}))])
    assert wide.open_read([RowRequest.of("w", torch.arange(40), 1)]).parts[0].chunk == READ_CHUNK_BYTES // (65536 * 4)


@pytest.mark.parametrize("sorted_ids", [True, False])
def test_pushes_between_chunks_do_not_change_the_answer(monkeypatch, sorted_ids: bool) -> None:
    monkeypatch.setattr(row_read, "READ_CHUNK_IDS", 7)
    store = _store()
    _push(store, 0, torch.arange(0, 40, 3))  # some rows held, most initial
    ids = torch.arange(40) if sorted_ids else torch.randperm(40, generator=torch.Generator().manual_seed(1))
    ids = torch.cat([ids, ids[:5]])  # duplicates too
    expected = store.pull([("t", ids)])[0]
    version = store.version
    read = store.open_read([RowRequest.of("t", ids, 1)])
    clock = 1
    while read.step():  # between chunks: overwrite held rows, create new ones, twice each
        _push(store, clock, torch.arange(0, 40, 2))
        _push(store, clock + 1, torch.arange(0, 40))
        clock += 2
    read.close()
    assert read.version == version and store.version > version
    assert torch.equal(read.result()[0], expected)  # the opening version's rows, bitwise
    assert not store.tables["t"].readers
    now = store.pull([("t", ids)])[0]
    assert not torch.equal(now, expected)


def test_rows_never_updated_read_as_their_initial_values() -> None:
    store = _store()
    ids = torch.tensor([7, 10**8, 3])
    assert torch.equal(store.pull([("t", ids)])[0], initial_rows("t", 5, 1.0, ids, 4))
