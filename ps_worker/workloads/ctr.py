"""``ctr``: click-through-rate prediction with a DLRM-style model on a synthetic click log whose best
achievable AUC is known (:mod:`ps_worker.workloads.clicklog`; ``docs/ctr.md``).

Model (:class:`DLRM`; Naumov et al. 2019, "Deep Learning Recommendation Model for Personalization and
Recommendation Systems", arXiv:1906.00091, section 2 and figure 1): one ``EmbeddingBag(C_f + 1, dim,
mode="sum", sparse=True)`` table per categorical field ``f``; a raw id (anywhere in ``[0, 2^40)``) is
looked up at its index in the field's sorted vocabulary of ``C_f`` ids, an id outside it at the last row
(DLRM's Criteo preprocessing likewise maps raw categorical values to contiguous indices, so no two ids
share a row); a bottom MLP maps the dense features to a ``dim`` vector; the interaction layer takes the
dot product of every pair of the ``F + 1`` vectors (bottom output and one embedding per field: DLRM's
``dot`` interaction without self-pairs) and concatenates them to the bottom output; a top MLP turns that
into one logit. Loss: binary cross-entropy on the logit (``BCEWithLogits``).

The tables are ``sparse=True``: their gradients touch only the rows of the batch, and grpc-ps serves such
tables row by row from the shards (``ps_worker.tables.modules``; docs/tables.md), so a step
moves the batch's rows, not the tables. Their initial rows are N(0, 0.1^2), locally and on the shards
(``ps_init_std``). Default sizes: 125,756 rows of 16 float32 (7.7 MiB) over 6 tables, 5,233 dense
parameters; larger tables: raise ``ClickLogConfig.cardinalities`` (``docs/ctr.md``).

:meth:`CTRWorkload.evaluate` reports the held-out ``auc`` (ROC AUC, scikit-learn's ``roc_auc_score``),
``logloss`` (mean binary cross-entropy in nats, also as ``loss``), ``ground_truth_auc`` and
``ground_truth_logloss`` (the same for the generator's hidden click probabilities: the best any model
can do in expectation) and ``auc_gap`` (ground truth minus model).

Training recipe (``docs/ctr.md``): ``ps-launch --shards 2 --workers 2 --mode sync --optimizer adagrad
--lr 0.05 --batch-size 256 --steps 1600 ctr``. Adagrad (Duchi et al. 2011) is the usual choice for CTR
embeddings: a row's step shrinks with its own history, and rows a batch does not touch do not move.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from ps_worker.workloads.clicklog import ClickLog, ClickLogConfig, generate, vocabulary


@dataclass(frozen=True)
class DLRMConfig:
    """Sizes of :class:`DLRM`.

    Attributes:
        table_rows: rows of each field's embedding table (its vocabulary's size + 1 for unknown ids).
        dim: embedding width, also the bottom MLP's output width.
        num_dense: dense input features.
        bottom: hidden widths of the bottom MLP (dense features -> ``dim``).
        top: hidden widths of the top MLP (interactions -> 1 logit).
        init_std: standard deviation of the tables' initial rows.
    """

    table_rows: tuple[int, ...]
    dim: int = 16
    num_dense: int = 4
    bottom: tuple[int, ...] = (32,)
    top: tuple[int, ...] = (64, 32)
    init_std: float = 0.1

    def __post_init__(self) -> None:
        if not self.table_rows or min(self.table_rows) < 1:
            raise ValueError(f"table_rows needs one positive row count per field; got {self.table_rows}.")
        if min(self.dim, self.num_dense, *self.bottom, *self.top) < 1:
            raise ValueError("dim, num_dense and every hidden width must be >= 1.")
        if not self.init_std > 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}.")

    @property
    def num_interactions(self) -> int:
        """Pairs among the ``F + 1`` interacting vectors: ``(F + 1) F / 2``."""
        n = len(self.table_rows) + 1
        return n * (n - 1) // 2


def mlp(widths: tuple[int, ...], last_relu: bool) -> nn.Sequential:
    """Linear layers ``widths[0] -> widths[1] -> ...`` with ReLU between (and after the last if asked)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM (Naumov et al. 2019) with dot interactions; see the module docstring.

    Input: float64 ``[batch, num_dense + F]``: the dense features, then one raw id per field (ids below
    2^53 are exact in float64; the click log's are below 2^40). Output: float32 ``[batch]`` logits.
    """

    def __init__(self, cfg: DLRMConfig, vocabularies: list[torch.Tensor]) -> None:
        super().__init__()
        if [len(v) + 1 for v in vocabularies] != list(cfg.table_rows):
            raise ValueError("Each table needs one row per vocabulary id plus one for unknown ids.")
        self.cfg = cfg
        self.bottom = mlp((cfg.num_dense, *cfg.bottom, cfg.dim), last_relu=True)
        tables = [nn.EmbeddingBag(rows, cfg.dim, mode="sum", sparse=True) for rows in cfg.table_rows]
        # DLRM's reference code draws a table from U(-sqrt(1/rows), sqrt(1/rows)), which shrinks with the table;
        # a fixed N(0, init_std^2) is used instead, and told to the shards (ps_init_std: a shard-served table
        # draws its own rows from that law, ps_worker.tables.modules), so in-process and sharded runs start alike
        for table in tables:
            nn.init.normal_(table.weight, 0.0, cfg.init_std)
            setattr(table, "ps_init_std", cfg.init_std)  # noqa: B010 - an attribute nn.EmbeddingBag lacks
        self.tables = nn.ModuleList(tables)
        self.top = mlp((cfg.dim + cfg.num_interactions, *cfg.top, 1), last_relu=False)
        n = len(cfg.table_rows) + 1
        # plain tensors, not buffers: grpc-ps moves a model's buffers with its parameters every step
        self.pairs = torch.tril_indices(n, n, offset=-1)  # [2, (F + 1) F / 2]: the pairs (i, j), i > j
        self.vocabularies = list(vocabularies)  # sorted int64 ids per field
        self._vocab_on: dict[tuple[int, torch.device], torch.Tensor] = {}

    def rows(self, f: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows of field ``f``'s table for int64 ``ids`` ``[batch]``: the id's index in the sorted vocabulary,
        or the last row for an id outside it."""
        vocab = self._vocab_on.get((f, ids.device))
        if vocab is None:  # copied once per device (the prefetcher reads CPU batches, the model may be on a GPU)
            vocab = self._vocab_on[(f, ids.device)] = self.vocabularies[f].to(ids.device)
        at = torch.searchsorted(vocab, ids).clamp_(max=len(vocab) - 1)
        return torch.where(vocab[at] == ids, at, len(vocab))

    def table_inputs(self, x: torch.Tensor) -> dict[nn.Module, torch.Tensor]:
        """Each table module -> the int64 row indices ``[batch]`` its forward looks up for input ``x``
        (what ``ps_worker.RowPrefetcher`` prefetches)."""
        ids = x[:, self.cfg.num_dense :].to(torch.int64)
        return {table: self.rows(f, ids[:, f].contiguous()) for f, table in enumerate(self.tables)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dense = x[:, : self.cfg.num_dense].float()
        ids = x[:, self.cfg.num_dense :].to(torch.int64)
        z = self.bottom(dense)  # [batch, dim]
        bags = [self.rows(f, ids[:, f].contiguous()).unsqueeze(1) for f in range(len(self.tables))]  # [batch, 1] each
        vectors = [z] + [table(bag) for table, bag in zip(self.tables, bags, strict=True)]
        t = torch.stack(vectors, dim=1)  # [batch, F + 1, dim]
        i, j = self.pairs.to(t.device)
        dots = torch.bmm(t, t.transpose(1, 2))[:, i, j]  # [batch, (F + 1) F / 2]
        return self.top(torch.cat([z, dots], dim=1)).squeeze(1)


class ClickLogDataset(TensorDataset):
    """``(x, y)`` pairs of a :class:`~ps_worker.workloads.clicklog.ClickLog`: x float64 ``[D + F]`` (dense
    features, then raw ids), y float32 scalar click; ``probability`` keeps the hidden float64 ``[n]``."""

    def __init__(self, log: ClickLog) -> None:
        x = np.concatenate([log.dense.astype(np.float64), log.ids.astype(np.float64)], axis=1)
        super().__init__(torch.from_numpy(x), torch.from_numpy(log.clicks))
        self.probability = torch.from_numpy(log.probability)


def binary_logloss(p: np.ndarray, y: np.ndarray) -> float:
    """Mean binary cross-entropy in nats of probabilities ``p`` for labels ``y`` (both ``[n]``)."""
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


class CTRWorkload:
    """DLRM on the synthetic click log (module docstring).

    Args:
        clicklog: the generator's parameters (fields, cardinalities, Zipf exponents, hidden weights).
        train_size: training impressions.
        held_out_size: held-out impressions (AUC and log loss are measured on all of them).
        dim: embedding width.
        table_options: the tables' admission, expiry and bound (``ps_common.tables.TableSpec`` fields
            ``admit_after``, ``expire_after_rounds``, ``expire_after_seconds``, ``max_bytes``, ``on_full``;
            none by default).
    """

    name = "ctr"

    def __init__(
        self,
        clicklog: ClickLogConfig | None = None,
        *,
        train_size: int = 1_000_000,
        held_out_size: int = 50_000,
        dim: int = 16,
        table_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.table_options = dict(table_options or {})
        self.clicklog = clicklog or ClickLogConfig()
        if train_size < 1 or held_out_size < 2:
            raise ValueError(f"train_size must be >= 1 and held_out_size >= 2; got {train_size}, {held_out_size}.")
        self.train_size = train_size
        self.held_out_size = held_out_size
        self.config = DLRMConfig(
            table_rows=tuple(c + 1 for c in self.clicklog.cardinalities),
            dim=dim,
            num_dense=self.clicklog.num_dense,
        )

    def model(self) -> torch.nn.Module:
        vocabularies = [torch.from_numpy(vocabulary(self.clicklog, f)) for f in range(self.clicklog.num_fields)]
        model = DLRM(self.config, vocabularies)
        for table in model.tables:  # admission, expiry, a bound: TableSpec fields (docs/tables.md)
            setattr(table, "ps_table_options", self.table_options)  # noqa: B010 - an attribute nn.EmbeddingBag lacks
        return model

    def datasets(self) -> tuple[Dataset, Dataset]:
        train = generate(self.clicklog, self.train_size, stream=0)
        held_out = generate(self.clicklog, self.held_out_size, stream=1)
        return ClickLogDataset(train), ClickLogDataset(held_out)

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, held_out: Dataset, batch_size: int = 8192) -> dict[str, float]:
        """Held-out ``auc``, ``logloss`` (= ``loss``), ``ground_truth_auc``, ``ground_truth_logloss``, ``auc_gap``.

        Raises:
            TypeError: ``held_out`` is not a :class:`ClickLogDataset` (the ground truth would be unknown).
        """
        if not isinstance(held_out, ClickLogDataset):
            raise TypeError(f"ctr evaluates a ClickLogDataset, not {type(held_out).__name__}.")
        x, y = held_out.tensors
        logits = torch.cat([model(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])
        p_model = torch.sigmoid(logits.double()).numpy()
        labels = y.numpy()
        truth = held_out.probability.numpy()
        auc = float(roc_auc_score(labels, p_model))
        truth_auc = float(roc_auc_score(labels, truth))
        logloss = binary_logloss(p_model, labels)
        return {
            "auc": auc,
            "logloss": logloss,
            "loss": logloss,
            "ground_truth_auc": truth_auc,
            "ground_truth_logloss": binary_logloss(truth, labels),
            "auc_gap": truth_auc - auc,
        }
