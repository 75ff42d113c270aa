"""Optimizer specs: an allowlist of torch.optim classes and numeric kwargs, nothing executable."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from ps_common.errors import InvalidRequestError
from ps_common.optimizer import OPTIMIZERS, OptimizerSpec
from ps_common.optimizer_args import KWARGS, PAIRS, TORCH_CLASSES, set_group_value


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


def test_torch_range_errors_are_refused_with_the_spec() -> None:
    with pytest.raises(InvalidRequestError, match=r"beta1=1.5 of 'adam' must be in \[0, 1\)"):
        OptimizerSpec("adam", {"lr": 0.1, "beta1": 1.5})


def test_the_names_are_torch_s_classes_and_their_arguments_torch_s_keywords() -> None:
    """Every argument is a keyword of the class's signature in this torch, or one element of a
    tuple keyword (betas, etas, step_sizes); every numeric keyword of torch is offered."""
    switches = {"params", "foreach", "fused", "capturable", "differentiable"}
    for name, cls in OPTIMIZERS.items():
        assert cls is getattr(torch.optim, TORCH_CLASSES[name])
        torch_args = set(inspect.signature(cls).parameters) - switches
        ours = {PAIRS[k][0] if k in PAIRS else k for k in KWARGS[name]}
        if name == "adam":  # Adam(decoupled_weight_decay=True) is AdamW: the spec says "adamw"
            torch_args.discard("decoupled_weight_decay")
        assert ours == torch_args, name


@pytest.mark.parametrize(
    ("name", "kwargs", "torch_kwargs"),
    [
        ("sgd", {"momentum": 0.9, "nesterov": 1, "maximize": 1}, {"nesterov": True, "maximize": True}),
        ("adamw", {"amsgrad": 1, "maximize": 1, "beta2": 0.9}, {"amsgrad": True, "betas": (0.9, 0.9)}),
        ("rmsprop", {"centered": 1, "alpha": 0.5}, {"centered": True, "alpha": 0.5}),
        ("adadelta", {"rho": 0.5, "maximize": 1}, {"rho": 0.5, "maximize": True}),
        ("adamax", {"beta1": 0.5}, {"betas": (0.5, 0.999)}),
        ("nadam", {"momentum_decay": 0.01, "decoupled_weight_decay": 1}, {"decoupled_weight_decay": True}),
        ("radam", {"decoupled_weight_decay": 1, "weight_decay": 0.1}, {"decoupled_weight_decay": True}),
        ("asgd", {"lambd": 0.01, "alpha": 0.5, "t0": 3}, {"lambd": 0.01, "alpha": 0.5, "t0": 3.0}),
        ("rprop", {"eta_plus": 1.5}, {"etas": (0.5, 1.5), "step_sizes": (1e-6, 50.0)}),
        ("rprop", {"eta_minus": 0.25, "step_size_max": 2.0}, {"etas": (0.25, 1.2), "step_sizes": (1e-6, 2.0)}),
    ],
)
def test_flags_and_pairs_reach_torch(name, kwargs, torch_kwargs) -> None:
    group = OptimizerSpec(name, {"lr": 0.01, **kwargs}).build([torch.ones(1)]).param_groups[0]
    for k, v in torch_kwargs.items():
        assert group[k] == v and type(group[k]) is type(v), (k, group[k])


def test_a_group_overriding_one_element_of_a_pair_keeps_the_other() -> None:
    spec = OptimizerSpec("rprop", {"lr": 0.01, "eta_minus": 0.3}, groups=((("b",), {"eta_plus": 1.4}),))
    groups = spec.build([torch.ones(1), torch.ones(1)], [0, 1]).param_groups
    assert groups[0]["etas"] == (0.3, 1.2) and groups[1]["etas"] == (0.3, 1.4)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("adadelta", {"lr": 1.0, "betas": 0.9}, "takes no argument 'betas'"),
        ("rprop", {"lr": 0.1, "etas": 0.5}, "takes no argument 'etas'"),
        ("asgd", {"lr": 0.1, "momentum": 0.9}, "takes no argument 'momentum'"),
        ("adam", {"lr": 0.1, "decoupled_weight_decay": 1}, "takes no argument"),
        ("nadam", {"lr": 0.1, "decoupled_weight_decay": 2}, "flag"),
        ("radam", {"lr": 0.1, "maximize": 0.5}, "flag"),
        ("adamw", {"lr": 0.1, "amsgrad": -1}, "finite number >= 0"),
        ("adadelta", {"lr": 1.0, "rho": 1.5}, r"rho=1.5 of 'adadelta' must be in \[0, 1\]"),
        ("rprop", {"lr": 0.1, "eta_minus": 1.0}, r"eta_minus=1.0 .* must be in \(0, 1\)"),
        ("rprop", {"lr": 0.1, "eta_minus": 0.0}, "eta_minus"),
        ("rprop", {"lr": 0.1, "eta_plus": 0.9}, r"eta_plus=0.9 .* must be in \(1, inf\)"),
        ("nadam", {"lr": 0.1, "beta2": 1.0}, r"torch.optim.NAdam refuses"),
        ("asgd", {"lr": 0.1, "t0": float("inf")}, "finite"),
    ],
)
def test_bad_arguments_of_every_optimizer_are_refused(name, kwargs, message) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        OptimizerSpec(name, kwargs)


def test_a_group_s_out_of_range_value_is_refused_although_torch_checks_only_its_constructor() -> None:
    with pytest.raises(InvalidRequestError, match="eta_plus"):
        OptimizerSpec("rprop", {"lr": 0.1}, groups=((("b",), {"eta_plus": 0.5}),))


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("sgd", {"lr": 0.1, "momentum": 0.0, "nesterov": 1}, "Nesterov"),
        ("sgd", {"lr": 0.1, "momentum": 0.9, "dampening": 0.5, "nesterov": 1}, "Nesterov"),
    ],
)
def test_torch_s_own_checks_become_invalid_request(name, kwargs, message) -> None:
    with pytest.raises(InvalidRequestError, match=f"rejected its arguments: {message}"):
        OptimizerSpec(name, kwargs).build([torch.ones(1)])


@pytest.mark.parametrize(
    ("name", "pushed", "message"),
    [
        ("rprop", {"eta_plus": 1.0}, "eta_plus"),
        ("adadelta", {"rho": 2.0}, "rho"),
        ("nadam", {"decoupled_weight_decay": 0}, "not 'decoupled_weight_decay'"),
        ("rprop", {"maximize": 1}, "not 'maximize'"),
        ("asgd", {"t0": -1.0}, "finite number >= 0"),
    ],
)
def test_pushed_hyperparameters_are_checked_as_the_spec_s(name, pushed, message) -> None:
    spec = OptimizerSpec(name, {"lr": 0.1})
    with pytest.raises(InvalidRequestError, match=message):
        spec.check_hyperparameters([pushed], 1)


def test_the_pushable_hyperparameters_are_the_numeric_arguments() -> None:
    assert OptimizerSpec("rprop", {"lr": 0.1}).hyperparameter_names == {
        "lr",
        "eta_minus",
        "eta_plus",
        "step_size_min",
        "step_size_max",
    }
    assert OptimizerSpec("asgd", {"lr": 0.1}).hyperparameter_names == {"lr", "lambd", "alpha", "t0", "weight_decay"}
    OptimizerSpec("rprop", {"lr": 0.1}).check_hyperparameters([{"eta_plus": 1.1, "step_size_max": 3.0}], 1)


def test_set_group_value_writes_one_element_of_a_pair() -> None:
    group: dict[str, object] = {"lr": 0.1, "etas": (0.5, 1.2), "betas": (0.9, 0.999)}
    set_group_value(group, "eta_plus", 1.5)
    set_group_value(group, "beta1", 0.8)
    set_group_value(group, "lr", 0.2)
    assert group == {"lr": 0.2, "etas": (0.5, 1.5), "betas": (0.8, 0.999)}


def test_the_table_imports_no_torch() -> None:
    code = "import sys, ps_common.optimizer_args as a; print('torch' in sys.modules, len(a.OPTIMIZER_NAMES))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "11"]
