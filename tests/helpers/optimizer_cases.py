"""Every server optimizer with non-default arguments and flags, each as the spec a worker sends and
the torch.optim optimizer it stands for, written out with torch's own keywords."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

Params = Iterable[Any]  # tensors, or torch param-group dicts


@dataclass(frozen=True)
class Case:
    """``spec``: the client.init spec (groups by parameter name); ``torch_optimizer(groups)``: the
    same optimizer over ``groups`` (``[{"params": rest}, {"params": named}, ...]`` as the spec's
    groups list them); ``changes``: step -> (values a worker sets in group 0, torch's equivalents)."""

    spec: dict[str, Any]
    torch_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
    changes: dict[int, tuple[dict[str, float], dict[str, Any]]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def group_keys(self) -> list[list[str]]:
        """The parameter names of the spec's groups 1, 2..."""
        return [list(g["params"]) for g in self.spec.get("groups", [])]

    def server_spec(self) -> tuple[str, dict[str, float], tuple[tuple[tuple[str, ...], dict[str, float]], ...]]:
        """(name, kwargs, groups) as :class:`~ps_common.optimizer.OptimizerSpec` takes them."""
        kwargs = {k: float(v) for k, v in self.spec.items() if k not in ("name", "groups")}
        groups = tuple(
            (tuple(g["params"]), {k: float(v) for k, v in g.items() if k != "params"})
            for g in self.spec.get("groups", [])
        )
        return self.name, kwargs, groups


o = torch.optim
CASES: dict[str, Case] = {
    "sgd": Case({"name": "sgd", "lr": 0.05}, lambda g: o.SGD(g, lr=0.05)),
    "sgd-nesterov": Case(
        {"name": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": 1, "weight_decay": 0.01},
        lambda g: o.SGD(g, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    ),
    "sgd-maximize": Case(
        {"name": "sgd", "lr": 0.05, "momentum": 0.8, "dampening": 0.2, "maximize": 1},
        lambda g: o.SGD(g, lr=0.05, momentum=0.8, dampening=0.2, maximize=True),
    ),
    "adam": Case(
        {"name": "adam", "lr": 0.01, "beta1": 0.8, "weight_decay": 0.01},
        lambda g: o.Adam(g, lr=0.01, betas=(0.8, 0.999), weight_decay=0.01),
    ),
    "adam-amsgrad-maximize": Case(
        {"name": "adam", "lr": 0.01, "amsgrad": 1, "maximize": 1, "eps": 1e-6},
        lambda g: o.Adam(g, lr=0.01, amsgrad=True, maximize=True, eps=1e-6),
    ),
    "adamw-groups": Case(
        {"name": "adamw", "lr": 0.01, "weight_decay": 0.1, "groups": [{"params": ["0.bias", "2.bias"], "beta2": 0.9}]},
        lambda g: o.AdamW(g, lr=0.01, weight_decay=0.1),
    ),
    "adamw-amsgrad": Case(
        {"name": "adamw", "lr": 0.01, "weight_decay": 0.1, "amsgrad": 1, "beta2": 0.99},
        lambda g: o.AdamW(g, lr=0.01, weight_decay=0.1, amsgrad=True, betas=(0.9, 0.99)),
    ),
    "adagrad": Case(
        {"name": "adagrad", "lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1, "maximize": 1},
        lambda g: o.Adagrad(g, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1, maximize=True),
    ),
    "rmsprop": Case({"name": "rmsprop", "lr": 0.01}, lambda g: o.RMSprop(g, lr=0.01)),
    "rmsprop-centered": Case(
        {"name": "rmsprop", "lr": 0.01, "alpha": 0.9, "momentum": 0.9, "centered": 1, "weight_decay": 0.01},
        lambda g: o.RMSprop(g, lr=0.01, alpha=0.9, momentum=0.9, centered=True, weight_decay=0.01),
    ),
    "adadelta": Case(
        {"name": "adadelta", "lr": 1.0, "rho": 0.8, "eps": 1e-5, "weight_decay": 0.01},
        lambda g: o.Adadelta(g, lr=1.0, rho=0.8, eps=1e-5, weight_decay=0.01),
    ),
    "adadelta-maximize": Case(
        {"name": "adadelta", "lr": 0.5, "maximize": 1},
        lambda g: o.Adadelta(g, lr=0.5, maximize=True),
    ),
    "adamax": Case(
        {"name": "adamax", "lr": 0.01, "beta1": 0.8, "beta2": 0.99, "weight_decay": 0.01},
        lambda g: o.Adamax(g, lr=0.01, betas=(0.8, 0.99), weight_decay=0.01),
    ),
    "nadam": Case(
        {"name": "nadam", "lr": 0.01, "momentum_decay": 0.01, "weight_decay": 0.01},
        lambda g: o.NAdam(g, lr=0.01, momentum_decay=0.01, weight_decay=0.01),
    ),
    "nadam-decoupled": Case(
        {"name": "nadam", "lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": 1, "maximize": 1},
        lambda g: o.NAdam(g, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True, maximize=True),
    ),
    "radam": Case({"name": "radam", "lr": 0.01, "beta2": 0.9}, lambda g: o.RAdam(g, lr=0.01, betas=(0.9, 0.9))),
    "radam-decoupled": Case(
        {"name": "radam", "lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": 1, "beta2": 0.9},
        lambda g: o.RAdam(g, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True, betas=(0.9, 0.9)),
    ),
    "asgd": Case(
        {"name": "asgd", "lr": 0.01, "lambd": 0.001, "alpha": 0.5, "t0": 2, "weight_decay": 0.01},
        lambda g: o.ASGD(g, lr=0.01, lambd=0.001, alpha=0.5, t0=2, weight_decay=0.01),
        changes={3: ({"t0": 1.0}, {"t0": 1.0})},
    ),
    "rprop": Case(
        {"name": "rprop", "lr": 0.01, "eta_minus": 0.4, "eta_plus": 1.3, "step_size_min": 1e-5, "step_size_max": 0.5},
        lambda g: o.Rprop(g, lr=0.01, etas=(0.4, 1.3), step_sizes=(1e-5, 0.5)),
        changes={3: ({"eta_plus": 1.1, "step_size_max": 0.05}, {"etas": (0.4, 1.1), "step_sizes": (1e-5, 0.05)})},
    ),
    "rprop-groups-maximize": Case(
        {"name": "rprop", "lr": 0.01, "maximize": 1, "groups": [{"params": ["2.weight"], "eta_minus": 0.3}]},
        lambda g: o.Rprop(g, lr=0.01, maximize=True),
    ),
}
"""Each optimizer with non-default arguments; groups cases give group 1 its overrides in torch too
(:func:`torch_groups`). RAdam's rectified branch starts at step 6 with beta2 0.9 (rho_t > 5),
ASGD's averaging after t0."""


def torch_groups(case: Case, named: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """torch param groups for ``case`` over ``named`` (parameter name -> tensor): group 0 the
    parameters in no spec group, then each spec group with its overrides in torch's keywords."""
    listed = {k for keys in case.group_keys() for k in keys}
    groups: list[dict[str, Any]] = [{"params": [p for k, p in named.items() if k not in listed]}]
    pairs = {"beta1": ("betas", 0), "beta2": ("betas", 1), "eta_minus": ("etas", 0), "eta_plus": ("etas", 1)}
    base = case.torch_optimizer([{"params": [torch.zeros(1)]}]).defaults
    for g in case.spec.get("groups", []):
        group: dict[str, Any] = {"params": [named[k] for k in g["params"]]}
        for k, v in g.items():
            if k in pairs:
                name, i = pairs[k]
                pair = list(group.get(name, base[name]))
                pair[i] = float(v)
                group[name] = tuple(pair)
            elif k != "params":
                group[k] = float(v)
        groups.append(group)
    return groups
