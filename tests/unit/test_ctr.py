"""The ctr workload without a network: the click-log generator (determinism, Zipf ids, ground truth), the
DLRM model's shapes and sparse gradients, evaluation against an oracle, and in-process training that
reaches the ground-truth AUC within 0.01."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader

from ps_worker.workloads.clicklog import (
    ID_BITS,
    ClickLogConfig,
    generate,
    hashed_normal,
    mix_ids,
    true_logit,
    vocabulary,
    zipf_cdf,
)
from ps_worker.workloads.ctr import DLRM, ClickLogDataset, CTRWorkload
from ps_worker.workloads.registry import WORKLOADS, get_workload

SMALL = ClickLogConfig(cardinalities=(1000, 50), zipf_exponents=(1.2, 1.3), id_scales=(0.5, 0.5), pairs=((0, 1),))


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine two spinning threads run the loop 5-10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_registered() -> None:
    assert "ctr" in WORKLOADS
    assert isinstance(get_workload("ctr"), CTRWorkload)


def test_generator_is_deterministic_and_streams_differ() -> None:
    a, b = generate(SMALL, 2000, stream=0), generate(SMALL, 2000, stream=0)
    for field in ("dense", "ids", "clicks", "probability"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    held = generate(SMALL, 2000, stream=1)
    other_seed = generate(ClickLogConfig(**{**SMALL.__dict__, "seed": 1}), 2000, stream=0)
    assert not np.array_equal(a.ids, held.ids) and not np.array_equal(a.ids, other_seed.ids)
    assert a.dense.shape == (2000, 4) and a.dense.dtype == np.float32
    assert a.ids.shape == (2000, 2) and a.ids.dtype == np.int64
    assert a.clicks.dtype == np.float32 and set(np.unique(a.clicks)) == {0.0, 1.0}


def test_ids_are_a_bijection_of_ranks_spread_over_2_to_the_40() -> None:
    ranks = np.arange(1 << 16)
    ids = mix_ids(ranks, 0)
    assert len(np.unique(ids)) == len(ranks)  # distinct ranks, distinct ids
    assert ids.min() >= 0 and ids.max() < 1 << ID_BITS
    assert ids.max() > 1 << (ID_BITS - 2)  # spread, not dense
    assert not np.array_equal(ids, mix_ids(ranks, 1))  # each field its own bijection
    cfg = ClickLogConfig()
    vocab = vocabulary(cfg, 0)
    assert len(vocab) == cfg.cardinalities[0] and np.all(np.diff(vocab) > 0)
    log = generate(cfg, 5000, stream=0)
    for f in range(cfg.num_fields):
        assert np.isin(log.ids[:, f], vocabulary(cfg, f)).all()


def test_ids_follow_the_truncated_zipf_law() -> None:
    cfg = ClickLogConfig()
    n = 200_000
    log = generate(cfg, n, stream=0)
    for f in (0, 5):
        card, a = cfg.cardinalities[f], cfg.zipf_exponents[f]
        expected = np.diff(np.concatenate([[0.0], zipf_cdf(card, a)]))[:5]
        counts = np.array([(log.ids[:, f] == i).sum() for i in mix_ids(np.arange(5), f)])
        # binomial standard error of each frequency is below 0.0012 at n = 200,000
        assert np.abs(counts / n - expected).max() < 0.006, (f, counts / n, expected)
    head = (log.ids[:, 0] == mix_ids(np.arange(1), 0)[0]).mean()
    assert head > 0.15  # the most popular of 100,000 ids is in more than 15 % of impressions (a = 1.2)


def test_hashed_weights_are_standard_normal_and_fixed_per_id() -> None:
    ids = mix_ids(np.arange(100_000), 0)
    w = hashed_normal(ids, 0, 0)
    assert abs(w.mean()) < 0.02 and abs(w.std() - 1) < 0.02
    assert np.array_equal(w, hashed_normal(ids, 0, 0))
    assert abs(np.corrcoef(w, hashed_normal(ids, 0, 1))[0, 1]) < 0.02  # slots are independent
    assert abs(np.corrcoef(w, hashed_normal(ids, 1, 0))[0, 1]) < 0.02  # so are fields
    assert abs(np.corrcoef(w, hashed_normal(ids, 0, 0, seed=1))[0, 1]) < 0.02  # and seeds


def test_ground_truth_is_the_documented_logistic_model_with_a_sane_auc() -> None:
    cfg = ClickLogConfig()
    log = generate(cfg, 50_000, stream=1)
    z = true_logit(cfg, log.dense, log.ids)
    assert np.allclose(log.probability, 1 / (1 + np.exp(-z)))
    assert abs(log.clicks.mean() - log.probability.mean()) < 0.01  # Bernoulli(p) clicks
    auc = roc_auc_score(log.clicks, log.probability)
    assert 0.70 < auc < 0.85, auc
    assert auc == pytest.approx(0.8238, abs=5e-4)  # docs/ctr.md's figure for the default held-out set


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="one entry per field"):
        ClickLogConfig(cardinalities=(10, 10), zipf_exponents=(1.1,), id_scales=(0.5, 0.5), pairs=())
    with pytest.raises(ValueError, match="two different fields"):
        ClickLogConfig(pairs=((0, 0),))
    with pytest.raises(ValueError, match="latent_dim in 1..62"):
        ClickLogConfig(latent_dim=63)
    with pytest.raises(ValueError, match="Zipf exponents"):
        ClickLogConfig(zipf_exponents=(1.2, 0.0, 1.1, 1.2, 1.3, 1.3))


def test_dlrm_shapes_sparse_gradients_and_unknown_ids() -> None:
    w = CTRWorkload(SMALL, train_size=256, held_out_size=64)
    torch.manual_seed(0)
    model = w.model()
    assert isinstance(model, DLRM)
    assert [t.num_embeddings for t in model.tables] == [1001, 51]
    assert all(t.sparse for t in model.tables)
    assert not list(model.buffers())  # grpc-ps would move buffers (the 1 MB of vocabularies) every step
    assert model.cfg.num_interactions == 3  # 3 vectors (bottom + 2 fields), 3 pairs
    train, held = w.datasets()
    assert isinstance(train, ClickLogDataset) and isinstance(held, ClickLogDataset)
    assert len(train) == 256 and len(held) == 64
    x, y = next(iter(DataLoader(train, batch_size=32)))
    assert x.shape == (32, 4 + 2) and x.dtype == torch.float64 and y.shape == (32,) and y.dtype == torch.float32
    logits = model(x)
    assert logits.shape == (32,) and logits.dtype == torch.float32
    loss = w.loss(model, x, y)
    assert loss.shape == () and loss.item() > 0
    loss.backward()
    table = model.tables[0]
    assert isinstance(table, torch.nn.EmbeddingBag)
    grad = table.weight.grad
    assert grad is not None and grad.is_sparse
    touched = grad.coalesce().indices()[0].unique()
    assert 0 < len(touched) <= 32  # only the batch's rows
    vocab0 = torch.from_numpy(vocabulary(SMALL, 0))
    unknown = torch.tensor([1 << 39, 3], dtype=torch.int64)
    assert not torch.isin(unknown, vocab0).any()
    assert model.rows(0, unknown).tolist() == [1000, 1000]  # the last row
    assert model.rows(0, vocab0[[0, 999]]).tolist() == [0, 999]


class Oracle(torch.nn.Module):
    """Outputs the generator's hidden logit: the best possible model."""

    def __init__(self, cfg: ClickLogConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.cfg.num_dense
        return torch.from_numpy(true_logit(self.cfg, x[:, :d].numpy(), x[:, d:].to(torch.int64).numpy())).float()


def test_evaluate_gives_the_oracle_the_ground_truth() -> None:
    w = CTRWorkload(SMALL, train_size=1000, held_out_size=20_000)
    _, held = w.datasets()
    oracle = w.evaluate(Oracle(SMALL), held)
    assert oracle["auc"] == pytest.approx(oracle["ground_truth_auc"], abs=1e-6)
    assert oracle["logloss"] == pytest.approx(oracle["ground_truth_logloss"], abs=1e-6)
    assert oracle["loss"] == oracle["logloss"] and abs(oracle["auc_gap"]) < 1e-6
    torch.manual_seed(0)
    untrained = w.evaluate(w.model().eval(), held)
    assert untrained["auc"] < oracle["auc"] - 0.05 and untrained["logloss"] > oracle["logloss"]
    with pytest.raises(TypeError, match="ClickLogDataset"):
        w.evaluate(Oracle(SMALL), torch.utils.data.TensorDataset(torch.zeros(2, 6), torch.zeros(2)))


@pytest.mark.timeout(240)
def test_in_process_training_reaches_the_ground_truth_auc_within_0_01(one_thread) -> None:
    """The recipe of docs/ctr.md in one process: 800 Adagrad steps of batch 1,024 (= 2 sync workers x 512).
    About 10-15 s on an idle core (3 s of it generating the data)."""
    w = CTRWorkload()
    torch.manual_seed(0)
    model = w.model()
    train, held = w.datasets()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    loader = DataLoader(train, batch_size=1024, shuffle=True, generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for step, (x, y) in enumerate(loader):
        if step == 800:
            break
        opt.zero_grad()
        w.loss(model, x, y).backward()
        opt.step()
    seconds = time.perf_counter() - start
    scores = w.evaluate(model.eval(), held)
    assert scores["auc_gap"] < 0.01, (scores, seconds)
    assert scores["logloss"] < scores["ground_truth_logloss"] + 0.015, scores
