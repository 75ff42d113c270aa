"""Row-wise optimizers of embedding tables: state only for the rows a gradient touches.

Each update takes the touched rows' values, their (coalesced: one row per id) gradient and their
state, gathered from a table's storage, and returns new values and state; the caller checks them
and writes them back (all or nothing). Untouched rows and their state do not change ("lazy"), as
torch does for sparse gradients:

- ``sgd``: ``buf = momentum * buf + g``; ``p -= lr * buf`` (``buf = g`` without momentum), with
  ``g += weight_decay * p`` first. Without momentum and weight decay this is exactly
  ``torch.optim.SGD`` on a sparse gradient; with them it is the lazy form (a row's buffer decays
  only on the steps that touch it; TensorFlow's lazy momentum).
- ``adagrad``: torch.optim.Adagrad's sparse path (Duchi, Hazan, Singer, JMLR 2011):
  ``clr = lr / (1 + (step - 1) * lr_decay)``, ``sum += g**2``, ``p -= clr * g / (sqrt(sum) + eps)``.
- ``adam``: torch.optim.SparseAdam (lazy Adam; Kingma and Ba, ICLR 2015, Algorithm 1, moments
  updated for touched rows only), op for op as ``torch.optim._functional.sparse_adam``, with the
  table's step count for the bias corrections.

``step`` is the table's update count including this one (1 on the first update), as torch's
per-parameter ``state["step"]``.
"""

from __future__ import annotations

import math

import torch

from ps_common.tables import RowOptimizerSpec

STATE_NAMES = {"sgd": ("momentum_buffer",), "adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq")}
"""Per-row state tensors of each row optimizer ([rows, dim] float32 each; sgd's only with momentum)."""


def state_names(spec: RowOptimizerSpec) -> tuple[str, ...]:
    """Names of the per-row state tensors ``spec`` keeps."""
    if spec.name == "sgd" and spec.get("momentum", 0.0) == 0.0:
        return ()
    return STATE_NAMES[spec.name]


def initial_state(spec: RowOptimizerSpec, n: int, dim: int) -> dict[str, torch.Tensor]:
    """Fresh state of ``n`` rows: zeros (adagrad's sum: ``initial_accumulator_value``), float32 [n, dim]."""
    fill = spec.get("initial_accumulator_value", 0.0) if spec.name == "adagrad" else 0.0
    return {name: torch.full((n, dim), fill, dtype=torch.float32) for name in state_names(spec)}


def update_rows(
    spec: RowOptimizerSpec,
    rows: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    step: int,
    lr: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One row-wise optimizer step of the touched rows.

    Args:
        spec: the table's row optimizer.
        rows: float32 [n, dim], the touched rows' values (not modified).
        grad: float32 [n, dim], their gradient, one row per distinct id.
        state: name -> float32 [n, dim], their state (not modified).
        step: the table's update count including this one (>= 1).
        lr: the learning rate (None: ``spec``'s).

    Returns:
        (new rows [n, dim], new state), fresh tensors.
    """
    lr = spec.get("lr", 0.0) if lr is None else lr
    p = rows.clone()
    new = {k: v.clone() for k, v in state.items()}
    if spec.name == "sgd":
        g = grad
        wd = spec.get("weight_decay", 0.0)
        if wd:
            g = g.add(p, alpha=wd)
        if "momentum_buffer" in new:
            buf = new["momentum_buffer"].mul_(spec.get("momentum", 0.0)).add_(g)
            g = buf
        p.add_(g, alpha=-lr)
    elif spec.name == "adagrad":
        clr = lr / (1 + (step - 1) * spec.get("lr_decay", 0.0))
        total = new["sum"].add_(grad.pow(2))
        std = total.sqrt().add_(spec.get("eps", 1e-10))
        p.add_(grad / std, alpha=-clr)
    else:  # adam: torch.optim._functional.sparse_adam on the touched rows
        beta1, beta2, eps = spec.get("beta1", 0.9), spec.get("beta2", 0.999), spec.get("eps", 1e-8)
        old_exp_avg = state["exp_avg"]
        exp_avg_update = grad.sub(old_exp_avg).mul_(1 - beta1)
        new["exp_avg"].add_(exp_avg_update)
        old_exp_avg_sq = state["exp_avg_sq"]
        exp_avg_sq_update = grad.pow(2).sub_(old_exp_avg_sq).mul_(1 - beta2)
        new["exp_avg_sq"].add_(exp_avg_sq_update)
        numer = exp_avg_update.add_(old_exp_avg)
        exp_avg_sq_update.add_(old_exp_avg_sq)
        denom = exp_avg_sq_update.sqrt_().add_(eps)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr * math.sqrt(bias_correction2) / bias_correction1
        p.add_(-step_size * numer.div_(denom))
    return p, new
