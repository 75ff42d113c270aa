"""Server-side optimizer specs: a name from an allowlist of torch.optim classes plus numeric kwargs.

Nothing executable crosses the wire (compare MXNet's pickled optimizers). All allowed optimizers
are elementwise, so stepping each partition on its own equals stepping the whole parameter. Which
names and arguments there are: :mod:`ps_common.optimizer_args`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ps_common.errors import InvalidRequestError
from ps_common.optimizer_args import KWARGS, PAIRS, RANGES, TORCH_CLASSES, TUPLES

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    name: getattr(torch.optim, cls) for name, cls in TORCH_CLASSES.items()
}
"""Server optimizer name -> torch.optim class (the table: :mod:`ps_common.optimizer_args`)."""


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
        allowed = KWARGS[self.name]
        for k, v in kwargs.items():
            if k not in allowed:
                raise InvalidRequestError(
                    f"Optimizer {self.name!r} takes no argument {k!r}; allowed: {', '.join(sorted(allowed))}."
                )
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise InvalidRequestError(f"Optimizer argument {k}={v!r} must be a finite number >= 0.")
            if allowed[k] is bool and v not in (0, 1):
                raise InvalidRequestError(f"Optimizer argument {k} is a flag; send 0 or 1, got {v}.")
            self._check_torch_range(k, v)

    def _check_torch_range(self, name: str, value: float) -> None:
        """Refuse a value torch.optim's constructor would refuse (:data:`RANGES`); torch checks
        only its constructor's arguments, not param groups' or later assignments, so this does."""
        interval = RANGES.get(name)
        if interval is not None and value not in interval:
            raise InvalidRequestError(
                f"Optimizer argument {name}={value!r} of {self.name!r} must be in {interval} "
                f"(torch.optim.{TORCH_CLASSES[self.name]} refuses other values)."
            )

    @property
    def hyperparameter_names(self) -> frozenset[str]:
        """The arguments a push may set per step (:meth:`check_hyperparameters`): the numeric ones, no flags."""
        return frozenset(k for k, t in KWARGS[self.name].items() if t is float)

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
                self._check_torch_range(k, v)

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
        """``values`` as torch.optim keyword arguments: flags as bool, pairs as torch's tuples
        (beta1/beta2 -> betas, eta_minus/eta_plus -> etas, step_size_min/step_size_max ->
        step_sizes; an element not given is the spec's, else torch's default)."""
        allowed = KWARGS[self.name]
        kwargs: dict[str, object] = {}
        for k, v in values.items():
            if k not in PAIRS:
                kwargs[k] = bool(v) if allowed[k] is bool else float(v)
        base = {**self.kwargs, **values}
        for tuple_name in dict.fromkeys(PAIRS[k][0] for k in values if k in PAIRS):
            defaults = inspect.signature(OPTIMIZERS[self.name]).parameters[tuple_name].default
            kwargs[tuple_name] = tuple(float(base.get(k, d)) for k, d in zip(TUPLES[tuple_name], defaults, strict=True))
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
