"""The table of server optimizers: which torch.optim class each name runs and the numeric keyword
arguments it takes. Imports no torch, so command lines list the choices without loading it.

Every optimizer here is elementwise: an element's update reads only that element's parameter,
gradient and state (and per-parameter scalars such as the step count), so stepping each partition
of a parameter on its own equals stepping the whole parameter (``docs/architecture.md``).
"""

from __future__ import annotations

import json
import math
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from ps_common.errors import InvalidRequestError
from ps_common.text import quote

TORCH_CLASSES: dict[str, str] = {
    "sgd": "SGD",
    "adam": "Adam",
    "adamw": "AdamW",
    "adagrad": "Adagrad",
    "rmsprop": "RMSprop",
    "adadelta": "Adadelta",
    "adamax": "Adamax",
    "nadam": "NAdam",
    "radam": "RAdam",
    "asgd": "ASGD",
    "rprop": "Rprop",
}
"""Server optimizer name -> the class of ``torch.optim`` it runs."""

OPTIMIZER_NAMES: tuple[str, ...] = tuple(TORCH_CLASSES)
"""Every name a spec may carry (``OptimizerSpec.name``), in the order the docs list them."""

_ADAM = {"lr": float, "beta1": float, "beta2": float, "eps": float, "weight_decay": float}

KWARGS: dict[str, dict[str, type]] = {
    "sgd": {
        "lr": float,
        "momentum": float,
        "dampening": float,
        "weight_decay": float,
        "nesterov": bool,
        "maximize": bool,
    },
    "adam": {**_ADAM, "amsgrad": bool, "maximize": bool},
    "adamw": {**_ADAM, "amsgrad": bool, "maximize": bool},
    "adagrad": {
        "lr": float,
        "lr_decay": float,
        "weight_decay": float,
        "initial_accumulator_value": float,
        "eps": float,
        "maximize": bool,
    },
    "rmsprop": {
        "lr": float,
        "alpha": float,
        "eps": float,
        "weight_decay": float,
        "momentum": float,
        "centered": bool,
        "maximize": bool,
    },
    "adadelta": {"lr": float, "rho": float, "eps": float, "weight_decay": float, "maximize": bool},
    "adamax": {**_ADAM, "maximize": bool},
    "nadam": {**_ADAM, "momentum_decay": float, "decoupled_weight_decay": bool, "maximize": bool},
    "radam": {**_ADAM, "decoupled_weight_decay": bool, "maximize": bool},
    "asgd": {"lr": float, "lambd": float, "alpha": float, "t0": float, "weight_decay": float, "maximize": bool},
    "rprop": {
        "lr": float,
        "eta_minus": float,
        "eta_plus": float,
        "step_size_min": float,
        "step_size_max": float,
        "maximize": bool,
    },
}
"""Per optimizer, the keyword arguments it takes: ``float`` (a number; a push may set it each
step) or ``bool`` (a flag, sent as 0 or 1, fixed at Init). torch's implementation switches
(foreach, fused, capturable, differentiable) are not arguments: they do not change the math."""

TUPLES: dict[str, tuple[str, str]] = {
    "betas": ("beta1", "beta2"),
    "etas": ("eta_minus", "eta_plus"),
    "step_sizes": ("step_size_min", "step_size_max"),
}
"""torch's tuple arguments -> the pair of numeric arguments that stand for their elements."""

PAIRS: dict[str, tuple[str, int]] = {name: (t, i) for t, names in TUPLES.items() for i, name in enumerate(names)}
"""A numeric argument that is one element of a torch tuple -> (the tuple's name, its index)."""


@dataclass(frozen=True)
class Interval:
    """The values torch.optim's constructors accept for one argument (beyond finite and >= 0)."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


RANGES: dict[str, Interval] = {
    "beta1": Interval(0.0, 1.0, high_open=True),
    "beta2": Interval(0.0, 1.0, high_open=True),
    "rho": Interval(0.0, 1.0),
    "eta_minus": Interval(0.0, 1.0, low_open=True, high_open=True),
    "eta_plus": Interval(1.0, math.inf, low_open=True, high_open=True),
}
"""Arguments torch.optim (2.13) range-checks beyond ``>= 0``: Adam's family ``0 <= beta < 1``,
Adadelta ``0 <= rho <= 1``, Rprop ``0 < eta_minus < 1 < eta_plus``. Checked on specs and on
pushed hyperparameters alike (a push bypasses torch's constructor)."""


def set_group_value(group: MutableMapping[str, object], name: str, value: float) -> None:
    """Set numeric argument ``name`` in a torch.optim param group: one element of its tuple for a
    pair (``beta1`` -> ``group["betas"][0]``), else ``group[name]``."""
    if name in PAIRS:
        tuple_name, index = PAIRS[name]
        pair = list(group[tuple_name])  # type: ignore[call-overload]
        pair[index] = float(value)
        group[tuple_name] = tuple(pair)
    else:
        group[name] = float(value)


DILOCO_OUTER_OPTIMIZER = '{"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": true}'
"""DiLoCo's outer optimizer (Douillard et al. 2023, section 3: Nesterov momentum, lr 0.7, momentum 0.9)."""


def argument_problem(name: str, key: str, value: object) -> str:
    """What is wrong with argument ``key`` = ``value`` of optimizer ``name`` ("" if nothing): a flag
    takes true, false, 0 or 1; a number is finite, >= 0 (a JSON ``true`` is no number) and in
    torch's :data:`RANGES`. The checks ``ps_common.optimizer.OptimizerSpec`` makes, without torch."""
    allowed = KWARGS[name]
    if key not in allowed:
        return f"has no argument {quote(key)}; it takes {', '.join(allowed)}"
    if allowed[key] is bool:
        flag = isinstance(value, int | float) and value in (0, 1)
        return "" if flag else f"takes {key} true or false, not {quote(json.dumps(value)[:40])}"
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        return f"takes {key} as a finite number >= 0, not {quote(json.dumps(value)[:40])}"
    interval = RANGES.get(key)
    if interval is not None and value not in interval:
        return f"takes {key} in {interval} (torch.optim.{TORCH_CLASSES[name]} refuses {value!r})"
    return ""


def outer_optimizer_json(text: str) -> dict[str, Any]:
    """diloco's ``--outer-optimizer`` as a spec dict: a JSON object with a ``name`` of :data:`KWARGS`,
    an ``lr``, and arguments that pass :func:`argument_problem` (what the workers' Init checks, so
    a shard refuses at its start what no worker could send).

    Raises:
        InvalidRequestError: in one sentence: not such an object (nested deeper than the parser
            goes, too), an unknown name or argument, a value out of range, or no lr.
    """
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack
        spec = None
    if not isinstance(spec, dict) or spec.get("name") not in KWARGS:
        raise InvalidRequestError(
            f"--outer-optimizer must be a JSON object naming one of {', '.join(OPTIMIZER_NAMES)}, e.g. "
            f"{DILOCO_OUTER_OPTIMIZER}; got {quote(text)}."
        )
    problems = [argument_problem(spec["name"], k, v) for k, v in spec.items() if k != "name"]
    problem = next((p for p in problems if p), "" if "lr" in spec else "needs an lr")
    if problem:
        raise InvalidRequestError(f"--outer-optimizer: {spec['name']} {problem}.")
    return spec
