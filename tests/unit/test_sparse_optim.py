"""Row-wise optimizers (ps_server.tables.sparse_optim) against torch's own sparse-gradient optimizers."""

from __future__ import annotations

import pytest
import torch

from ps_common.errors import InvalidRequestError
from ps_common.tables import RowOptimizerSpec, TableSpec
from ps_server.tables.table import Table

ROWS, DIM = 50, 3


def _torch_run(name: str, kwargs: dict[str, float], steps: list[tuple[torch.Tensor, torch.Tensor]], init: torch.Tensor):
    """torch's optimizer on an nn.Embedding(sparse=True) weight, one sparse gradient per step."""
    weight = torch.nn.Parameter(init.clone())
    if name == "sgd":
        opt = torch.optim.SGD([weight], lr=kwargs["lr"])
    elif name == "adagrad":
        opt = torch.optim.Adagrad([weight], lr=kwargs["lr"], lr_decay=kwargs.get("lr_decay", 0.0), eps=kwargs["eps"])
    else:
        opt = torch.optim.SparseAdam(
            [weight], lr=kwargs["lr"], betas=(kwargs["beta1"], kwargs["beta2"]), eps=kwargs["eps"]
        )
    for ids, grads in steps:
        weight.grad = torch.sparse_coo_tensor(ids[None, :], grads, (ROWS, DIM), check_invariants=True).coalesce()
        opt.step()
    return weight.detach()


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("sgd", {"lr": 0.1}),
        ("adagrad", {"lr": 0.3, "eps": 1e-10, "lr_decay": 0.01}),
        ("adam", {"lr": 0.05, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}),
    ],
)
def test_row_optimizers_equal_torch_sparse_optimizers(name: str, kwargs: dict[str, float]) -> None:
    spec = TableSpec("t", ROWS, DIM, RowOptimizerSpec(name, kwargs), seed=3)
    table = Table(spec, 0, 1, max_rows=ROWS)
    gen = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(6):
        ids = torch.unique(torch.randint(0, ROWS, (12,), generator=gen))
        steps.append((ids, torch.randn(ids.numel(), DIM, generator=gen)))
    init = table.read(torch.arange(ROWS))
    for ids, grads in steps:
        table.apply(ids, grads)
    expected = _torch_run(name, kwargs, steps, init)
    assert torch.equal(table.read(torch.arange(ROWS)), expected)  # bitwise: the same ops in the same order
    touched = torch.unique(torch.cat([i for i, _ in steps]))
    assert table.rows == touched.numel()  # state only for touched rows


def test_lazy_momentum_touches_only_pushed_rows() -> None:
    spec = TableSpec("t", ROWS, DIM, RowOptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.9}))
    table = Table(spec, 0, 1, max_rows=ROWS)
    before = table.read(torch.arange(ROWS))
    g = torch.ones(1, DIM)
    table.apply(torch.tensor([4]), g)
    table.apply(torch.tensor([7]), g)
    after = table.read(torch.arange(ROWS))
    assert torch.allclose(after[4], before[4] - 0.1)  # buf = g once: row 4 did not move on step 2
    assert torch.allclose(after[7], before[7] - 0.1)
    changed = (after != before).any(1).nonzero().flatten().tolist()
    assert changed == [4, 7]


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [("rmsprop", {"lr": 0.1}), ("sgd", {"lr": 0.1, "nesterov": 1.0}), ("adam", {"lr": 0.1, "beta1": 1.0}), ("sgd", {})],
)
def test_row_optimizer_allowlist(name: str, kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidRequestError):
        RowOptimizerSpec(name, kwargs)
