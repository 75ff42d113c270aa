"""Server-side optimizer specs: a name from an allowlist of torch.optim classes plus numeric kwargs.

Nothing executable crosses the wire (compare MXNet's pickled optimizers). All allowed optimizers
are elementwise, so stepping each partition on its own equals stepping the whole parameter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ps_common.errors import InvalidRequestError

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
    groups: tuple[tuple[tuple[str, ...], Mapping[str, float]], ...] = ()
    """Parameter groups 1, 2...: (parameter keys, kwargs overriding ``kwargs``); group 0 holds the
    parameters listed in none, with ``kwargs`` (as torch.optim's param_groups: [rest, *groups])."""
    buffers: tuple[str, ...] = ()
    """Plan keys that are module buffers: not trained, set to rank 0's pushed values each step."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise InvalidRequestError(
                f"Unknown optimizer {self.name!r}; expected one of {', '.join(sorted(OPTIMIZERS))}."
            )
        self._check_kwargs(self.kwargs)
        if "lr" not in self.kwargs:
            raise InvalidRequestError(f"Optimizer {self.name!r} needs a learning rate 'lr'.")
        seen: set[str] = set()
        for keys, kwargs in self.groups:
            self._check_kwargs(kwargs)
            repeated = seen.intersection(keys)
            if repeated or len(set(keys)) != len(keys):
                raise InvalidRequestError(
                    f"Parameter {sorted(repeated or keys)[0]!r} is in more than one optimizer group; list each once."
                )
            seen.update(keys)
        trained_buffers = seen.intersection(self.buffers)
        if trained_buffers:
            raise InvalidRequestError(
                f"{sorted(trained_buffers)[0]!r} is listed both as a buffer and in an optimizer group; buffers are "
                "not trained."
            )

    def _check_kwargs(self, kwargs: Mapping[str, float]) -> None:
        allowed = _KWARGS[self.name]
        for k, v in kwargs.items():
            if k not in allowed:
                raise InvalidRequestError(
                    f"Optimizer {self.name!r} takes no argument {k!r}; allowed: {', '.join(sorted(allowed))}."
                )
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise InvalidRequestError(f"Optimizer argument {k}={v!r} must be a finite number >= 0.")
            if allowed[k] is bool and v not in (0, 1):
                raise InvalidRequestError(f"Optimizer argument {k} is a flag; send 0 or 1, got {v}.")

    @property
    def hyperparameter_names(self) -> frozenset[str]:
        """The arguments a push may set per step (:meth:`check_hyperparameters`): the numeric ones, no flags."""
        return frozenset(k for k, t in _KWARGS[self.name].items() if t is float)

    def check_hyperparameters(self, groups: Sequence[Mapping[str, float]], num_groups: int) -> None:
        """Refuse per-step hyperparameters (one mapping per parameter group, as a push carries them)
        that are not numeric arguments of this optimizer, or not finite numbers >= 0.

        Raises:
            InvalidRequestError: wrong group count, unknown or flag argument, bad value.
        """
        if len(groups) != num_groups:
            raise InvalidRequestError(
                f"The push carries hyperparameters for {len(groups)} parameter groups but the shard's {self.name} "
                f"optimizer has {num_groups}; every worker must pass rank 0's optimizer groups to client.init."
            )
        names = self.hyperparameter_names
        for values in groups:
            for k, v in values.items():
                if k not in names:
                    raise InvalidRequestError(
                        f"A push may set {', '.join(sorted(names))} of optimizer {self.name!r}, not {k[:64]!r}."
                    )
                if not (math.isfinite(v) and v >= 0):
                    raise InvalidRequestError(f"Hyperparameter {k}={v!r} must be a finite number >= 0.")

    def check_range(self, dtypes: Iterable[torch.dtype]) -> None:
        """Refuse arguments a step cannot use on parameters of ``dtypes``: every numeric argument,
        and the product lr * weight_decay (AdamW's decay factor), must be at most the largest finite
        value of the narrowest floating dtype (float32: about 3.4e38), or the step raises.

        Raises:
            InvalidRequestError: an argument out of that range.
        """
        dtypes = list(dtypes)
        for kwargs in [self.kwargs, *({**self.kwargs, **g} for _, g in self.groups)]:
            check_hyperparameter_range(kwargs, dtypes)

    @property
    def num_groups(self) -> int:
        return 1 + len(self.groups)

    def group_of(self, keys: Iterable[str]) -> list[int]:
        """The group index of each parameter key (a key in no group: group 0)."""
        index = {k: i + 1 for i, (group_keys, _) in enumerate(self.groups) for k in group_keys}
        return [index.get(k, 0) for k in keys]

    def build(self, params: Iterable[torch.Tensor], groups: Sequence[int] | None = None) -> torch.optim.Optimizer:
        """The torch.optim optimizer over ``params`` (leaf tensors; their ``.grad`` is read).

        Args:
            groups: the group index of each tensor (see :meth:`group_of`); None: all in group 0.
        """
        params = list(params)
        groups = list(groups) if groups is not None else [0] * len(params)
        members: list[list[torch.Tensor]] = [[] for _ in range(self.num_groups)]
        for p, g in zip(params, groups, strict=True):
            members[g].append(p)
        overrides = [{}, *(kwargs for _, kwargs in self.groups)]
        param_groups = [{"params": ps, **self._torch_kwargs(kw)} for ps, kw in zip(members, overrides, strict=True)]
        try:
            return OPTIMIZERS[self.name](param_groups, **self._torch_kwargs(self.kwargs))  # type: ignore[arg-type]
        except ValueError as exc:  # torch's own range checks, e.g. beta >= 1
            raise InvalidRequestError(f"Optimizer {self.name!r} rejected its arguments: {exc}") from exc

    def _torch_kwargs(self, values: Mapping[str, float]) -> dict[str, object]:
        """``values`` as torch.optim keyword arguments: flags as bool, beta1/beta2 as betas."""
        allowed = _KWARGS[self.name]
        kwargs: dict[str, object] = {}
        for k, v in values.items():
            if k not in ("beta1", "beta2"):
                kwargs[k] = bool(v) if allowed[k] is bool else float(v)
        if "beta1" in values or "beta2" in values:
            base = {**self.kwargs, **values}
            kwargs["betas"] = (float(base.get("beta1", 0.9)), float(base.get("beta2", 0.999)))
        return kwargs


def check_hyperparameter_range(kwargs: Mapping[str, float], dtypes: Iterable[torch.dtype]) -> None:
    """Refuse arguments a step cannot use on parameters of ``dtypes``: every numeric argument, and
    the product lr * weight_decay, at most the largest finite value of the narrowest dtype.

    Raises:
        InvalidRequestError: an argument out of that range.
    """
    dtypes = list(dtypes)
    for k, v in kwargs.items():
        check_in_range(k, float(v), dtypes)
    decay = float(kwargs.get("lr", 0)) * float(kwargs.get("weight_decay", 0))
    check_in_range("lr * weight_decay", decay, dtypes)
