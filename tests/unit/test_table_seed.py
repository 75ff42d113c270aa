"""Seeding table rows at table init (a job started from a model file): the shard's checks and
exact store (``ps_server.tables.seed``) and the worker's chunks (``ps_worker.tables.seed``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps_common.errors import InvalidRequestError, PreconditionError, TableFullError
from ps_common.tables import RowOptimizerSpec, TableSpec, initial_rows, shard_of
from ps_proto.v1 import ps_pb2
from ps_server.policy import POLICIES
from ps_server.tables.seed import seed_rows
from ps_server.tables.store import TableStore
from ps_server.tables.table import RowGrads
from ps_worker.tables.seed import seed_blocks

SPEC = TableSpec("emb.weight", 1000, 4, RowOptimizerSpec("adagrad", {"lr": 0.5}), seed=3)


def block(ids: list[int], rows: torch.Tensor, table: str = "emb.weight") -> ps_pb2.RowBlock:
    return ps_pb2.RowBlock(
        table=table,
        ids=np.asarray(ids, dtype="<i8").tobytes(),
        dtype=ps_pb2.DTYPE_FLOAT32,
        data=rows.numpy().astype("<f4").tobytes(),
    )


def test_seeded_rows_are_stored_exactly_once_and_refused_when_bad_full_or_trained() -> None:
    store = TableStore(0, 1, max_rows=3)
    store.declare([SPEC])
    table = store.tables["emb.weight"]
    rows = torch.randn(3, 4)
    with pytest.raises(TableFullError):  # 4 rows beyond max_rows 3: nothing stored
        seed_rows(store, [block([1, 2, 3, 4], torch.randn(4, 4))])
    for bad in ([1, 1], [5, 1000], [-1, 2]):  # a row twice, out of range
        with pytest.raises(InvalidRequestError):
            seed_rows(store, [block(bad, torch.randn(2, 4))])
    with pytest.raises(InvalidRequestError, match="NaN"):
        seed_rows(store, [block([1], torch.full((1, 4), float("nan")))])
    with pytest.raises(InvalidRequestError, match="bytes of float32 rows"):
        seed_rows(store, [block([1], torch.randn(1, 3))])
    with pytest.raises(InvalidRequestError, match="Unknown table"):
        seed_rows(store, [block([1], torch.randn(1, 4), "other.weight")])
    assert table.rows == 0 and store.num_bytes == 0

    assert seed_rows(store, [block([7, 2, 9], rows)]) == 3
    assert seed_rows(store, [block([9, 7], rows[[2, 0]])]) == 2  # a retried chunk: nothing changes
    assert table.rows == 3 and table.step == 0 and store.version == 0
    other = rows[[2, 0]].clone()
    other[1, 3] += 1.0
    with pytest.raises(InvalidRequestError, match="2 rows seeded before other values"):  # another file's rows
        seed_rows(store, [block([9, 7], other)])
    assert table.rows == 3
    assert torch.equal(store.pull([("emb.weight", torch.tensor([2, 7, 9, 5]))])[0][:3], rows[[1, 0, 2]])
    assert torch.equal(table.state["sum"][: table.used], torch.zeros(3, 4))  # no optimizer state

    store.push(POLICIES["async"], 0, 1, 1, {"emb.weight": RowGrads(torch.tensor([7]), torch.ones(1, 4))})
    with pytest.raises(PreconditionError, match="before training"):
        seed_rows(store, [block([7], rows[:1])])
    assert not torch.equal(store.pull([("emb.weight", torch.tensor([7]))])[0], rows[:1])


def test_seed_rows_of_another_shard_are_refused() -> None:
    ids = torch.arange(50)
    theirs = int(ids[shard_of(ids, 2) == 1][0])
    store = TableStore(0, 2, max_rows=100)
    store.declare([SPEC])
    with pytest.raises(InvalidRequestError, match="belongs to shard 1"):
        seed_rows(store, [block([theirs], torch.randn(1, 4))])


def test_chunks_fit_the_budget_route_by_shard_and_leave_initial_rows_out() -> None:
    other = TableSpec("big.weight", 2**40, 3, SPEC.optimizer, seed=7)
    ids = torch.arange(0, 400)
    rows = initial_rows(SPEC.name, SPEC.seed, SPEC.init_std, ids, 4)
    changed = ids[::3]
    rows[changed] += 1.0
    rows[[1, 2], 3] += 1.0  # equal in the first element (compared first), not in the last
    changed = torch.cat([torch.tensor([1, 2]), changed]).sort().values
    hashed = torch.tensor([5, 2**39, 2**40 - 1])
    seeds = {"emb.weight": (ids, rows), "big.weight": (hashed, torch.randn(3, 3))}
    budget = 24 * 10 + 5  # ten rows of dim 4 (8 + 16 bytes each)
    per_shard = seed_blocks({"emb.weight": SPEC, "big.weight": other}, seeds, 3, budget)
    got: dict[str, dict[int, torch.Tensor]] = {"emb.weight": {}, "big.weight": {}}
    for k, requests in enumerate(per_shard):
        for request in requests:
            assert sum(len(b.ids) + len(b.data) for b in request) <= budget
            assert len({b.table for b in request}) == len(request)  # one block per table
            for b in request:
                i = torch.from_numpy(np.frombuffer(b.ids, dtype="<i8").copy())
                dim = 4 if b.table == "emb.weight" else 3
                r = torch.from_numpy(np.frombuffer(b.data, dtype="<f4").copy()).reshape(-1, dim)
                assert bool((shard_of(i, 3) == k).all())
                for one, row in zip(i.tolist(), r, strict=True):
                    assert one not in got[b.table]
                    got[b.table][one] = row
    assert sorted(got["emb.weight"]) == changed.tolist()  # rows equal to their initial values stay home
    assert all(torch.equal(got["emb.weight"][i], rows[i]) for i in changed.tolist())
    assert sorted(got["big.weight"]) == hashed.tolist()
    with pytest.raises(ValueError, match="float32"):
        seed_blocks({"emb.weight": SPEC}, {"emb.weight": (ids[:2], torch.zeros(2, 3))}, 1, budget)
