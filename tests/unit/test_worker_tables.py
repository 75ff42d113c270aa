"""The worker side of embedding tables without a network: which modules become tables, what the
model keeps, the row optimizer a spec gives, and the fixed-order coalescing (ps_worker.tables.modules,
ps_worker.tables.client)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ps_common.errors import InvalidRequestError
from ps_worker.tables.client import coalesce_rows
from ps_worker.tables.modules import ShardedEmbedding, attach_tables, row_optimizer


def _client() -> SimpleNamespace:
    return SimpleNamespace(
        transport=None,
        session=SimpleNamespace(rank=0),
        metrics=None,
        tables=None,
        partition_bytes=4 * 2**20,
        on_close=[],
    )


def test_sparse_embeddings_become_tables_and_leave_the_dense_parameters() -> None:
    model = nn.ModuleDict(
        {
            "emb": nn.Embedding(10_000_000, 64, sparse=True, device="meta"),
            "bag": nn.EmbeddingBag(100, 8, mode="mean", sparse=True),
            "sharded": ShardedEmbedding(2**40, 16, seed=3),
            "dense_emb": nn.Embedding(10, 4),  # sparse=False: an ordinary dense parameter
            "fc": nn.Linear(4, 1),
        }
    )
    client = _client()
    dense = attach_tables(client, model, {"name": "adam", "lr": 0.01, "beta1": 0.8, "weight_decay": 0.1})
    assert dense == {"name": "adam", "lr": 0.01, "beta1": 0.8, "weight_decay": 0.1}
    assert sorted(dict(model.named_parameters())) == ["dense_emb.weight", "fc.bias", "fc.weight"]
    specs = client.tables.specs
    assert list(specs) == ["emb.weight", "bag.weight", "sharded.weight"]
    assert (specs["emb.weight"].num_rows, specs["emb.weight"].dim) == (10_000_000, 64)
    assert specs["sharded.weight"].seed == 3 and specs["sharded.weight"].num_rows == 2**40
    assert specs["bag.weight"].optimizer.name == "adam" and dict(specs["bag.weight"].optimizer.kwargs) == {
        "lr": 0.01,
        "beta1": 0.8,
    }
    assert model["emb"].weight is None
    assert model["emb"].ps_table == "emb.weight" and client.on_close == [client.tables.close]  # prefetch threads


def test_row_optimizer_from_the_sparse_entry_or_the_dense_name() -> None:
    dense, row = row_optimizer({"name": "sgd", "lr": 0.1, "momentum": 0.9, "sparse": {"name": "adagrad", "lr": 0.05}})
    assert dense == {"name": "sgd", "lr": 0.1, "momentum": 0.9} and row.name == "adagrad"
    assert row_optimizer({"name": "sgd", "lr": 0.1, "nesterov": 1})[1].kwargs == {"lr": 0.1}
    with pytest.raises(ValueError, match="sparse"):
        row_optimizer({"name": "rmsprop", "lr": 0.1})
    with pytest.raises(InvalidRequestError):
        row_optimizer({"name": "sgd", "lr": 0.1, "sparse": {"name": "lbfgs", "lr": 1}})


def test_unsupported_embedding_options_are_refused() -> None:
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True, padding_idx=0))
    with pytest.raises(ValueError, match="padding_idx"):
        attach_tables(_client(), model, None)
    assert "0.weight" in dict(model.named_parameters())  # refused before anything changed


def test_a_model_without_tables_is_left_alone() -> None:
    model = nn.Linear(2, 2)
    client = _client()
    assert attach_tables(client, model, {"name": "sgd", "lr": 0.1, "sparse": {"name": "sgd", "lr": 1}}) == {
        "name": "sgd",
        "lr": 0.1,
    }
    assert client.tables is None and len(list(model.parameters())) == 2


def test_coalesce_rows_sums_duplicates_in_order() -> None:
    ids, grads = coalesce_rows(torch.tensor([9, 2, 9, 2]), torch.tensor([[1.0], [2.0], [3.0], [4.0]]))
    assert ids.tolist() == [2, 9] and grads.flatten().tolist() == [6.0, 4.0]
