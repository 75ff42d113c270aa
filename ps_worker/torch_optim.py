"""``torch.optim`` optimizers as the shards' optimizer spec: class, defaults and param groups,
matched to parameter names by identity (docs/architecture.md#9-worker-library).

:func:`translate` turns the optimizers a training script builds (one, or a list such as AdamW
over the dense parameters and SparseAdam over a sparse ``nn.EmbeddingBag``'s weight) into the
dict spec ``PSClient.init`` sends (``{"name": "adamw", "lr": ..., "beta1": ..., "groups":
[...], "sparse": {...}}``). The result, a :class:`Translation`, also keeps the user's own group
dicts, so the values a push carries (:meth:`Translation.hyperparameters`) are read from them at
every step: an lr scheduler on the user's optimizer reaches the shards.

Rules:

- Each parameter group becomes a server group; its values that differ from the first dense
  group's become the group's kwargs. torch tuples map to pairs (``betas`` -> ``beta1``/``beta2``,
  ``etas`` -> ``eta_minus``/``eta_plus``, ``step_sizes`` -> ``step_size_min``/``step_size_max``);
  a tensor lr becomes a float; ``foreach``, ``fused``, ``capturable``, ``differentiable`` are not
  sent (the shard picks its own; they do not change the math).
- Every trained parameter is in exactly one group of one optimizer, as under DDP; a frozen
  parameter (``requires_grad=False``) may be in none: it goes to a group with lr 0 (and
  weight_decay 0), so the zeros a step pushes for it never move it.
- The dense parameters take one class (the shards run one optimizer with groups); LBFGS (it needs
  a closure) and classes not in :data:`CLASSES` are refused, naming what runs on the shards.
- The weights of the model's sparse embedding tables take their row optimizer from their group:
  SparseAdam -> lazy adam, Adagrad -> adagrad, SGD -> sgd (``ps_common.tables.ROW_OPTIMIZERS``);
  an argument the row optimizer lacks must be at its neutral value (0, False).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ps_common import optimizer_args
from ps_common.tables import ROW_HYPERPARAMETERS, ROW_OPTIMIZERS

log = logging.getLogger(__name__)

CLASSES: dict[type[torch.optim.Optimizer], str] = {
    getattr(torch.optim, cls): name for name, cls in optimizer_args.TORCH_CLASSES.items()
}
"""The torch.optim classes the shards run, by their server optimizer name (``ps_common.optimizer_args``)."""

ROW_CLASSES: dict[type[torch.optim.Optimizer], str] = {
    torch.optim.SparseAdam: "adam",
    torch.optim.Adagrad: "adagrad",
    torch.optim.SGD: "sgd",
}
"""The torch.optim classes that step sparse embedding tables, by their row optimizer name."""

KWARGS: dict[str, tuple[str, ...]] = {name: tuple(args) for name, args in optimizer_args.KWARGS.items()}
"""The server optimizers' arguments (``ps_common.optimizer_args``), torch's tuples split into pairs."""

FLAGS = frozenset(k for args in optimizer_args.KWARGS.values() for k, kind in args.items() if kind is bool)
"""Arguments sent as 0/1; torch's default for each is False, so a false flag is not sent."""

PAIRS = optimizer_args.TUPLES

SWITCHES = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Implementation switches: how torch computes a step, not what it computes; not sent."""

IMPLIED: dict[str, dict[str, float]] = {"adamw": {"decoupled_weight_decay": 1.0}}
"""Arguments a class fixes by what it is (torch's AdamW is Adam with decoupled weight decay)."""

FROZEN = "frozen"


def supported() -> str:
    """The torch.optim class names the shards run, for messages."""
    return ", ".join(c.__name__ for c in CLASSES)


def is_torch_optimizer(optimizer: Any) -> bool:
    """True for a ``torch.optim.Optimizer`` or a non-empty list/tuple of them."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return True
    return (
        isinstance(optimizer, (list, tuple))
        and bool(optimizer)
        and all(isinstance(o, torch.optim.Optimizer) for o in optimizer)
    )


def as_list(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """``optimizer`` as a list of optimizers (refusing anything else with TypeError)."""
    opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    for o in opts:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"Expected torch.optim.Optimizer instances, got {type(o).__name__}.")
    return opts


def _number(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.item())
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    return float(value)


def _neutral(value: Any) -> bool:
    return value is None or (not isinstance(value, torch.Tensor) and not value)


def group_values(
    optimizer: torch.optim.Optimizer, group: Mapping[str, Any], allowed: Iterable[str], what: str
) -> dict[str, float]:
    """Every argument of ``group`` (a param group of ``optimizer``) as server kwargs: pairs split,
    flags 0/1, tensors as floats, switches and keys that are not the class's arguments (an lr
    scheduler's ``initial_lr``...) left out.

    Args:
        allowed: the server arguments (``KWARGS[name]`` or a row optimizer's).
        what: the server optimizer, for messages.

    Raises:
        ValueError: an argument the server optimizer lacks, not at its neutral value (0, False).
    """
    allowed = set(allowed)
    implied = IMPLIED.get(what, {})
    out: dict[str, float] = {}
    for key in optimizer.defaults:
        if key in SWITCHES or key not in group:
            continue
        value = group[key]
        items = list(zip(PAIRS[key], value, strict=True)) if key in PAIRS else [(key, value)]
        for name, v in items:
            if name in allowed:
                out[name] = _number(v)
            elif name in implied and _number(v) == implied[name]:
                continue
            elif not _neutral(v):
                raise ValueError(
                    f"{type(optimizer).__name__}({name}={v!r}) has no equivalent in the shards' {what} optimizer "
                    f"(arguments: {', '.join(sorted(allowed))}); leave {name} at its default."
                )
    return out


@dataclass
class Translation:
    """What :func:`translate` made of a script's optimizers.

    Attributes:
        optimizers: the user's optimizers, in the order given.
        name: the server optimizer of the dense parameters (``"adamw"``).
        spec: the dict spec ``PSClient.init`` sends (``groups`` by parameter name, ``sparse``).
        groups: per server group, the user's own param group dict whose current values a push
            carries (shared with the user's optimizer), or a fixed dict (the frozen group).
        table_group: the user's param group holding the tables' weights, or None.
        row_name: the tables' row optimizer (``"adam"``), or None.
    """

    optimizers: list[torch.optim.Optimizer]
    name: str
    spec: dict[str, Any]
    groups: list[Mapping[str, Any]] = field(default_factory=list)
    owners: list[torch.optim.Optimizer | None] = field(default_factory=list)
    table_group: Mapping[str, Any] | None = None
    table_owner: torch.optim.Optimizer | None = None
    row_name: str | None = None

    def hyperparameters(self, names: Iterable[str]) -> list[dict[str, float]]:
        """Per server group, its current values of ``names`` (the server optimizer's numeric
        arguments), read from the user's group dicts (what an lr scheduler set)."""
        names = set(names)
        out = []
        for owner, group in zip(self.owners, self.groups, strict=True):
            values = dict(group) if owner is None else group_values(owner, group, KWARGS[self.name], self.name)
            out.append({k: float(v) for k, v in values.items() if k in names})
        return out

    def row_hyperparameters(self) -> dict[str, float]:
        """The tables' row optimizer values a PushRows carries (``ps_common.tables.ROW_HYPERPARAMETERS``),
        read from the user's group (empty without tables)."""
        if self.table_group is None or self.table_owner is None or self.row_name is None:
            return {}
        values = group_values(self.table_owner, self.table_group, ROW_OPTIMIZERS[self.row_name], self.row_name)
        return {k: v for k, v in values.items() if k in ROW_HYPERPARAMETERS[self.row_name]}

    def check_matches(self, groups: Sequence[Sequence[str]], name: str) -> None:
        """Refuse when the shards' optimizer (``name`` with listed ``groups`` 1, 2...) is not this one.

        Raises:
            ValueError: another optimizer or other groups than client.init's.
        """
        mine = [sorted(g["params"]) for g in self.spec.get("groups", ())]
        if name != self.name or mine != [sorted(g) for g in groups]:
            raise ValueError(
                f"This optimizer translates to {self.name} with {1 + len(mine)} parameter groups, but the shards run "
                f"{name} with {1 + len(groups)} (rank 0's client.init): pass the same optimizer (or list) to "
                "client.init and DistributedOptimizer."
            )


def _place(
    opts: Sequence[torch.optim.Optimizer], names: Mapping[int, str], tables: Mapping[int, str]
) -> list[tuple[int, int, list[str], list[str]]]:
    """(optimizer index, group index, dense names, table names) of every group, each parameter once.

    Raises:
        ValueError: a parameter in two groups or optimizers, or not a parameter of the model.
    """
    seen: dict[int, str] = {}
    out = []
    for i, o in enumerate(opts):
        for j, group in enumerate(o.param_groups):
            dense, table = [], []
            for p in group["params"]:
                where = f"{type(o).__name__} #{i} group {j}"
                name = names.get(id(p)) or tables.get(id(p))
                if name is None:
                    raise ValueError(
                        f"{where} holds a tensor of shape {tuple(p.shape)} that is not a parameter of the model. Build "
                        "the optimizers from the model before client.init: init moves the weights of sparse embedding "
                        "tables to the shards (they leave model.parameters())."
                    )
                if id(p) in seen:
                    raise ValueError(
                        f"Parameter {name!r} is in {seen[id(p)]} and in {where}; list each parameter in one "
                        "optimizer group."
                    )
                seen[id(p)] = where
                (table if id(p) in tables else dense).append(name)
            out.append((i, j, dense, table))
    return out


def translate(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    named: Sequence[tuple[str, torch.Tensor]],
    tables: Mapping[str, torch.Tensor] | None = None,
) -> Translation:
    """The shards' optimizer spec of ``optimizer`` (see the module docstring).

    Args:
        optimizer: a ``torch.optim.Optimizer`` or a list of them.
        named: the model's dense parameters, ``model.named_parameters()`` (tied weights once).
        tables: table name (``"emb.weight"``) -> the weight of each sparse embedding table.

    Returns:
        The :class:`Translation`, whose ``spec`` ``PSClient.init`` takes.

    Raises:
        TypeError: not optimizers. ValueError: an unsupported class (LBFGS...), a parameter in no
            optimizer or in two, dense parameters under two classes or under SparseAdam, tables
            under an optimizer with no row-wise form or under groups with different values.
    """
    opts = as_list(optimizer)
    for o in opts:
        cls = type(o)
        if cls not in CLASSES and cls not in ROW_CLASSES:
            why = " (it needs a closure that re-evaluates the model)" if cls is torch.optim.LBFGS else ""
            raise ValueError(
                f"torch.optim.{cls.__name__} does not run on the shards{why}; they run {supported()}, and SparseAdam, "
                "Adagrad or SGD for sparse embedding tables."
            )
    tables = dict(tables or {})
    params = dict(named)
    names = {id(p): k for k, p in named}
    table_names = {id(w): k for k, w in tables.items()}
    placed = _place(opts, names, table_names)

    dense = [(opts[i], opts[i].param_groups[j], d) for i, j, d, _ in placed if d]
    for o, _, d in dense:
        if type(o) not in CLASSES:
            raise ValueError(
                f"torch.optim.{type(o).__name__} takes sparse embedding tables only, but it holds {d[0]!r}; the shards "
                f"run {supported()} for dense parameters. (client.init moves the tables' weights to the shards: "
                "build their optimizer from the model before client.init.)"
            )
    kinds = sorted({CLASSES[type(o)] for o, _, _ in dense})
    if len(kinds) > 1:
        raise ValueError(
            f"The dense parameters are under {' and '.join(kinds)}; the shards run one optimizer (with parameter "
            "groups) for them: use one class, with a group per setting."
        )
    listed = {n for _, _, d in dense for n in d}
    missing = [k for k, p in params.items() if k not in listed and p.requires_grad]
    if missing:
        raise ValueError(
            f"Parameter {missing[0]!r} is in no optimizer: every trained parameter must be in one, as under DDP "
            "(or set requires_grad=False to freeze it)."
        )
    frozen = [k for k in params if k not in listed]
    name = kinds[0] if kinds else "sgd"
    allowed = KWARGS[name]
    if dense:
        first, first_group, _ = dense[0]
        base = group_values(first, first_group, allowed, name)
    else:
        first, first_group, base = None, {"lr": 0.0}, {"lr": 0.0}
    spec: dict[str, Any] = {"name": name, **{k: v for k, v in base.items() if k not in FLAGS or v}}
    groups: list[dict[str, Any]] = []
    translation = Translation(opts, name, spec, [first_group], [first])
    for o, group, d in dense[1:]:
        values = group_values(o, group, allowed, name)
        keys = set(values) | set(base)
        groups.append(
            {"params": d, **{k: values.get(k, 0.0) for k in sorted(keys) if values.get(k, 0.0) != base.get(k, 0.0)}}
        )
        translation.groups.append(group)
        translation.owners.append(o)
    if frozen and dense:
        fixed = {"lr": 0.0, **({"weight_decay": 0.0} if "weight_decay" in allowed else {})}
        groups.append({"params": frozen, **fixed})
        translation.groups.append(fixed)
        translation.owners.append(None)
    if groups:
        spec["groups"] = groups
    _tables(translation, opts, placed, tables)
    return translation


def _tables(
    translation: Translation,
    opts: Sequence[torch.optim.Optimizer],
    placed: Sequence[tuple[int, int, list[str], list[str]]],
    tables: Mapping[str, torch.Tensor],
) -> None:
    """Set the tables' row optimizer of ``translation`` (``spec["sparse"]``) from their groups.

    Raises:
        ValueError: a table in no optimizer, under a class with no row-wise form, or tables under
            groups with different values.
    """
    if not tables:
        return
    held = [(opts[i], opts[i].param_groups[j], t) for i, j, _, t in placed if t]
    covered = {n for _, _, t in held for n in t}
    missing = [k for k, w in tables.items() if k not in covered and w.requires_grad]
    if missing:
        raise ValueError(
            f"Parameter {missing[0]!r} (a sparse embedding table) is in no optimizer: every trained parameter must be "
            "in one, as under DDP; sparse tables take torch.optim.SparseAdam, Adagrad or SGD."
        )
    if not held:
        return
    rows = []
    for o, group, t in held:
        row = ROW_CLASSES.get(type(o))
        if row is None:
            raise ValueError(
                f"Table {t[0]!r} is under torch.optim.{type(o).__name__}, which takes no sparse gradients; sparse "
                "embedding tables take SparseAdam, Adagrad or SGD (row optimizers "
                f"{', '.join(sorted(ROW_OPTIMIZERS))})."
            )
        rows.append((row, group_values(o, group, ROW_OPTIMIZERS[row], row)))
    if any(r != rows[0] for r in rows[1:]):
        raise ValueError(
            f"The sparse embedding tables are under groups with different settings ({rows[0]} and one of "
            f"{rows[1:]}); the shards run one row optimizer for every table: put the tables' weights in one group."
        )
    row, values = rows[0]
    if "lr" not in values or not math.isfinite(values["lr"]):
        raise ValueError(f"The tables' {type(held[0][0]).__name__} needs a finite learning rate 'lr'.")
    translation.spec["sparse"] = {"name": row, **values}
    translation.row_name = row
    translation.table_group = held[0][1]
    translation.table_owner = held[0][0]
