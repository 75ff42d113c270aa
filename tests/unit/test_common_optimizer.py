"""Optimizer specs: an allowlist of torch.optim classes and numeric kwargs, nothing executable."""

from __future__ import annotations

import pytest
import torch

from ps_common.errors import InvalidRequestError
from ps_common.optimizer import OPTIMIZERS, OptimizerSpec


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_allowed_optimizer_builds_and_steps(name: str) -> None:
    p = torch.ones(4)
    opt = OptimizerSpec(name, {"lr": 0.1}).build([p])
    assert isinstance(opt, OPTIMIZERS[name])
    p.grad = torch.ones(4)
    opt.step()
    assert not torch.equal(p, torch.ones(4))


def test_kwargs_reach_torch() -> None:
    opt = OptimizerSpec("adam", {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "amsgrad": 1}).build([torch.ones(1)])
    group = opt.param_groups[0]
    assert group["betas"] == (0.8, 0.99) and group["amsgrad"] is True and group["lr"] == 0.01


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("os.system", {"lr": 0.1}, "Unknown optimizer"),
        ("sgd", {}, "needs a learning rate"),
        ("sgd", {"lr": 0.1, "foreach": 1}, "takes no argument 'foreach'"),
        ("sgd", {"lr": float("nan")}, "finite"),
        ("sgd", {"lr": -1.0}, "finite number >= 0"),
        ("sgd", {"lr": 0.1, "nesterov": 0.5}, "flag"),
    ],
)
def test_bad_specs_are_refused(name, kwargs, message) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        OptimizerSpec(name, kwargs)


def test_torch_range_errors_become_invalid_request() -> None:
    with pytest.raises(InvalidRequestError, match="rejected"):
        OptimizerSpec("adam", {"lr": 0.1, "beta1": 1.5}).build([torch.ones(1)])
