"""Server-side optimizer specs: a name from an allowlist of torch.optim classes plus numeric kwargs.

Nothing executable crosses the wire (compare MXNet's pickled optimizers). All allowed optimizers
are elementwise, so stepping each partition on its own equals stepping the whole parameter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from ps_server.core.errors import InvalidRequestError

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
}

# Keyword arguments each optimizer accepts (numeric only); booleans are sent as 0/1.
_KWARGS: dict[str, dict[str, type]] = {
    "sgd": {"lr": float, "momentum": float, "dampening": float, "weight_decay": float, "nesterov": bool},
    "adam": {"lr": float, "beta1": float, "beta2": float, "eps": float, "weight_decay": float, "amsgrad": bool},
    "adamw": {"lr": float, "beta1": float, "beta2": float, "eps": float, "weight_decay": float, "amsgrad": bool},
    "adagrad": {
        "lr": float,
        "lr_decay": float,
        "weight_decay": float,
        "initial_accumulator_value": float,
        "eps": float,
    },
    "rmsprop": {"lr": float, "alpha": float, "eps": float, "weight_decay": float, "momentum": float, "centered": bool},
}


def check_in_range(name: str, value: float, dtypes: Iterable[torch.dtype]) -> None:
    """Refuse ``value`` (an optimizer argument such as the learning rate) when it is not a finite
    number >= 0 within the finite range of every floating dtype in ``dtypes``.

    Raises:
        InvalidRequestError: out of range; the message names the dtype and its largest value.
    """
    if not (math.isfinite(value) and value >= 0):
        raise InvalidRequestError(f"Optimizer argument {name}={value!r} must be a finite number >= 0.")
    for dtype in sorted({d for d in dtypes if d.is_floating_point}, key=lambda d: torch.finfo(d).max):
        limit = torch.finfo(dtype).max
        if value > limit:
            raise InvalidRequestError(
                f"Optimizer argument {name}={value:g} is beyond what {str(dtype).removeprefix('torch.')} parameters "
                f"hold (at most {limit:g}); a step would fail or overflow. Pick a value in range (learning rates "
                "are usually below 1)."
            )


@dataclass(frozen=True)
class OptimizerSpec:
    """A validated optimizer spec: ``name`` in :data:`OPTIMIZERS`, ``kwargs`` numeric.

    Raises:
        InvalidRequestError: unknown name, unknown kwarg, non-finite or negative value, missing lr.
    """

    name: str
    kwargs: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise InvalidRequestError(
                f"Unknown optimizer {self.name!r}; expected one of {', '.join(sorted(OPTIMIZERS))}."
            )
        allowed = _KWARGS[self.name]
        for k, v in self.kwargs.items():
            if k not in allowed:
                raise InvalidRequestError(
                    f"Optimizer {self.name!r} takes no argument {k!r}; allowed: {', '.join(sorted(allowed))}."
                )
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise InvalidRequestError(f"Optimizer argument {k}={v!r} must be a finite number >= 0.")
            if allowed[k] is bool and v not in (0, 1):
                raise InvalidRequestError(f"Optimizer argument {k} is a flag; send 0 or 1, got {v}.")
        if "lr" not in self.kwargs:
            raise InvalidRequestError(f"Optimizer {self.name!r} needs a learning rate 'lr'.")

    def check_range(self, dtypes: Iterable[torch.dtype]) -> None:
        """Refuse arguments a step cannot use on parameters of ``dtypes``: every numeric argument,
        and the product lr * weight_decay (AdamW's decay factor), must be at most the largest finite
        value of the narrowest floating dtype (float32: about 3.4e38), or the step raises.

        Raises:
            InvalidRequestError: an argument out of that range.
        """
        for k, v in self.kwargs.items():
            check_in_range(k, float(v), dtypes)
        decay = float(self.kwargs["lr"]) * float(self.kwargs.get("weight_decay", 0))
        check_in_range("lr * weight_decay", decay, dtypes)

    def build(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        """The torch.optim optimizer over ``params`` (leaf tensors; their ``.grad`` is read)."""
        allowed = _KWARGS[self.name]
        kwargs: dict[str, object] = {}
        betas = [0.9, 0.999]
        for k, v in self.kwargs.items():
            if k == "beta1":
                betas[0] = float(v)
            elif k == "beta2":
                betas[1] = float(v)
            else:
                kwargs[k] = bool(v) if allowed[k] is bool else float(v)
        if "beta1" in allowed:
            kwargs["betas"] = tuple(betas)
        try:
            return OPTIMIZERS[self.name](list(params), **kwargs)  # type: ignore[arg-type]
        except ValueError as exc:  # torch's own range checks, e.g. beta >= 1
            raise InvalidRequestError(f"Optimizer {self.name!r} rejected its arguments: {exc}") from exc
