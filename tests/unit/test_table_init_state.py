"""Where a table's rows start and how it shows in state_dict(), without a network: a sparse embedding
holding its weight is seeded from it by rank 0 (``ps_worker.tables.modules.initial_rows_from``), one on
the meta device or with admission/expiry starts from the declared initializer, and the module's
``state_dict()`` gathers the rows back (``ps_worker.tables.state``) within a size bound."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ps_worker.tables import state
from ps_worker.tables.modules import ShardedEmbedding, attach_tables


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
