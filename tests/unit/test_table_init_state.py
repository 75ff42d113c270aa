"""Where a table's rows start and how it shows in state_dict(), without a network: a sparse embedding
holding its weight is seeded from it by rank 0 (``ps_worker.tables.modules.initial_rows_from``), one on
the meta device or with admission/expiry starts from the declared initializer, and the module's
``state_dict()`` gathers the rows back (``ps_worker.tables.state``) within a size bound."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ps_admin.model_file import table_tensors
from ps_common.errors import InvalidRequestError
from ps_common.tables import RowOptimizerSpec, TableSpec
from ps_common.wire import table_spec_from_proto, table_spec_to_proto
from ps_server.tables.store import TableStore
from ps_server.tables.table_io import export_table, spec_from_export
from ps_worker.tables import state
from ps_worker.tables.modules import ShardedEmbedding, attach_tables

UNIFORM = {"initializer": "uniform", "init_low": -0.25, "init_high": 0.25}


def _client(rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        transport=None,
        session=SimpleNamespace(rank=rank),
        metrics=None,
        tables=None,
        partition_bytes=4 * 2**20,
        on_close=[],
    )


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 4, sparse=True)
        self.bag = nn.EmbeddingBag(30, 2, mode="sum", sparse=True)
        nn.init.uniform_(self.bag.weight, -(30**-0.5), 30**-0.5)  # DLRM's own initializer
        self.meta = nn.Embedding(10**9, 8, sparse=True, device="meta")
        self.sharded = ShardedEmbedding(2**40, 3)
        self.fc = nn.Linear(6, 1)


def test_rank_0_seeds_the_weights_it_holds_and_the_rest_start_from_the_declared_initializer() -> None:
    model = Model()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if k in ("emb.weight", "bag.weight")}
    model.emb.ps_table_options = {"admit_after": 2}  # a table that drops rows reads them back as declared
    client = _client()
    attach_tables(client, model, {"name": "adam", "lr": 0.01})
    seeds = client.tables.seeds
    assert sorted(seeds) == ["bag.weight"]  # not the admitting emb, not meta, not ShardedEmbedding
    ids, rows = seeds["bag.weight"]
    assert torch.equal(ids, torch.arange(30)) and torch.equal(rows, weights["bag.weight"])
    assert client.tables.matrices == ["emb.weight", "bag.weight", "meta.weight"]  # modules that held a weight

    other = _client(rank=1)
    attach_tables(other, Model(), {"name": "adam", "lr": 0.01})
    assert other.tables.seeds == {}  # as DDP, rank 0's values win

    forced = Model()
    forced.emb.ps_table_options = {"admit_after": 2}
    forced.emb.ps_init = "weight"
    forced.bag.ps_init = "declared"
    attach_tables(client := _client(), forced, {"name": "adam", "lr": 0.01})
    assert sorted(client.tables.seeds) == ["emb.weight"]


@pytest.mark.parametrize(("module", "value", "match"), [("meta", "weight", "meta device"), ("emb", "zeros", "one of")])
def test_a_bad_ps_init_is_refused_before_the_model_changes(module: str, value: str, match: str) -> None:
    model = Model()
    getattr(model, module).ps_init = value
    with pytest.raises(ValueError, match=match):
        attach_tables(_client(), model, {"name": "adam", "lr": 0.01})
    assert {"emb.weight", "bag.weight", "meta.weight"} <= set(dict(model.named_parameters()))


def _stub_tables(rows: dict[str, torch.Tensor]) -> SimpleNamespace:
    calls: list[tuple[str, int, int, int]] = []

    def pull(requests, min_version=None):
        ((name, ids),) = requests.items()
        calls.append((name, int(ids[0]), int(ids[-1]) + 1, min_version))
        return {name: rows[name][ids]}

    return SimpleNamespace(
        specs={},
        closed=False,
        matrices=[],
        seeds={},
        pull=pull,
        pull_floor=lambda: 7,
        calls=calls,
    )


def test_state_dict_gathers_the_tables_in_windows_and_loads_into_the_plain_model(monkeypatch) -> None:
    model = Model()
    plain = Model()
    client = _client()
    attach_tables(client, model, {"name": "adam", "lr": 0.01})
    trained = {"emb.weight": torch.randn(50, 4), "bag.weight": torch.randn(30, 2), "meta.weight": None}
    stub = _stub_tables(trained)
    stub.specs, stub.matrices = client.tables.specs, client.tables.matrices
    for m in (model.emb, model.bag, model.meta):  # point the hooks at the stub instead of the shards
        del m._save_to_state_dict, m._load_from_state_dict
        stub.matrices = []
        state.attach_state(m, stub, m.ps_table)
    monkeypatch.setattr(state, "WINDOW_ROWS", 16)
    del model.meta, plain.meta  # 10**9 x 8 rows: beyond the gather bound (below)
    got = model.state_dict()
    assert set(got) == set(plain.state_dict())  # the keys of the plain model, tables included
    assert torch.equal(got["emb.weight"], trained["emb.weight"]) and torch.equal(
        got["bag.weight"], trained["bag.weight"]
    )
    assert [c for c in stub.calls if c[0] == "emb.weight"] == [
        ("emb.weight", 0, 16, 7),
        ("emb.weight", 16, 32, 7),
        ("emb.weight", 32, 48, 7),
        ("emb.weight", 48, 50, 7),
    ]
    plain.load_state_dict(got)  # strict
    assert torch.equal(plain.emb.weight, trained["emb.weight"])
    assert "emb.weight" not in model.state_dict(keep_vars=True)  # the module's own tensors: no table
    with pytest.raises(RuntimeError, match="lives on the shards"):
        model.load_state_dict(got)


def test_a_table_beyond_the_gather_bound_is_refused_with_the_export_to_use() -> None:
    model = Model()
    client = _client()
    attach_tables(client, model, {"name": "adam", "lr": 0.01})
    with pytest.raises(ValueError, match="ps-admin export"):
        state.gather(client.tables, "meta.weight")


def test_a_declared_uniform_initializer_is_a_function_of_the_id_in_its_bounds_everywhere() -> None:
    spec = TableSpec("emb.weight", 2**40, 8, RowOptimizerSpec("adagrad", {"lr": 0.1}), 3, **UNIFORM)
    ids = torch.tensor([0, 5, 2**39 + 1, 2**40 - 1])
    rows = spec.initial(ids)
    assert rows.dtype == torch.float32 and rows.shape == (4, 8)
    assert bool((rows >= -0.25).all() and (rows < 0.25).all())
    assert torch.equal(rows[1:2], spec.initial(torch.tensor([5])))  # per id, whatever else is asked
    assert torch.equal(rows[:, :1], spec.initial(ids, 1))  # per element: the first column alone
    many = spec.initial(torch.arange(20_000), 1)
    assert abs(float(many.mean())) < 0.01 and abs(float(many.var()) - 0.5**2 / 12) < 0.001  # U(-0.25, 0.25)
    assert not torch.equal(rows, replace(spec, initializer="normal", init_low=0.0, init_high=0.0).initial(ids))

    # on the wire and in a checkpoint, and what a shard reads for a row it never stored
    assert table_spec_from_proto(table_spec_to_proto(spec)) == spec
    store = TableStore(0, 1, max_rows=100)
    store.declare([spec])
    assert torch.equal(store.pull([("emb.weight", ids)])[0], rows)
    saved = export_table(store.tables["emb.weight"])
    assert spec_from_export(saved) == spec
    old = {
        **saved,
        "spec": {k: v for k, v in saved["spec"].items() if k not in ("initializer", "init_low", "init_high")},
    }
    assert spec_from_export(old).initializer == "normal"  # a checkpoint from before the field
    message = table_spec_to_proto(spec)
    exported = table_tensors([message], {}, dense_limit=0)  # ps-admin export: held rows only past the limit
    assert exported["emb.weight.ids"].numel() == 0
    small = table_spec_to_proto(replace(spec, num_rows=6))
    assert torch.equal(table_tensors([small], {})["emb.weight"][[0, 5]], rows[:2])  # the matrix: as pulls read


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"initializer": "xavier"}, "one of normal, uniform"),
        ({"initializer": "uniform", "init_low": 0.5, "init_high": 0.5}, "init_low < init_high"),
        ({"initializer": "uniform", "init_low": float("-inf"), "init_high": 0.5}, "finite"),
        ({"init_low": -1.0, "init_high": 1.0}, "uniform' only"),
    ],
)
def test_bad_initializers_are_refused(fields: dict, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        TableSpec("t", 10, 2, RowOptimizerSpec("sgd", {"lr": 0.1}), **fields)


def test_modules_declare_a_uniform_initializer_with_ps_init() -> None:
    model = Model()
    model.meta.ps_init = ("uniform", -0.25, 0.25)  # DLRM's U(-1/sqrt(rows), 1/sqrt(rows)) for a table too big to hold
    model.sharded = ShardedEmbedding(2**40, 3, init=("uniform", -1.0, 2.0))
    model.emb.ps_init = ("normal", 0.1)
    client = _client()
    attach_tables(client, model, {"name": "adam", "lr": 0.01})
    specs = client.tables.specs
    assert specs["meta.weight"].uniform == (-0.25, 0.25) and specs["sharded.weight"].uniform == (-1.0, 2.0)
    assert specs["emb.weight"].uniform is None and specs["emb.weight"].init_std == 0.1
    assert sorted(client.tables.seeds) == ["bag.weight"]  # a declared initializer: nothing seeded
    bad = Model()
    bad.meta.ps_init = ("uniform", 1.0)
    with pytest.raises(ValueError, match="'uniform', low, high"):
        attach_tables(_client(), bad, {"name": "adam", "lr": 0.01})
