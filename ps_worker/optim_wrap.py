"""What ``PSClient.init`` and ``DistributedOptimizer`` do with a script's torch optimizers: the
spec of :func:`ps_worker.torch_optim.translate` at init, and the wrapped optimizer's groups,
shared with the user's, that each push reads its values from (docs/architecture.md#9-worker-library).

Horovod's pattern: ``DistributedOptimizer(model, client, opt)`` is built on ``opt.param_groups``
themselves, so an lr scheduler stepping either object changes the values the next push carries
(and, in easgd, the local optimizer's: it is ``opt``). torch's ``load_state_dict`` puts new group
dicts in place; :func:`keep_groups` writes their values back into the shared ones, so the groups stay
shared after any load (:func:`ps_worker.torch_state.adopt` also sends the torch state a load
puts in ``opt`` to the shards).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ps_worker.tables.modules import table_weights
from ps_worker.torch_optim import Translation, as_list, is_torch_optimizer, translate


def spec_of(model: torch.nn.Module, optimizer: Any) -> tuple[Translation | None, Mapping[str, Any] | None]:
    """``PSClient.init``'s optimizer as a dict spec: a torch optimizer (or list) translated
    against ``model`` (before its tables leave it), a dict spec or None as given.

    Returns:
        (the :class:`Translation` or None, the dict spec or None).

    Raises:
        TypeError: neither a mapping nor torch optimizers. ValueError: as :func:`translate`.
    """
    if optimizer is None or isinstance(optimizer, Mapping):
        return None, optimizer
    if not is_torch_optimizer(optimizer):
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer, a list of them, or a dict spec; got "
            f"{type(optimizer).__name__}."
        )
    tables = table_weights(model)
    named = [(k, p) for k, p in model.named_parameters() if k not in tables]
    translation = translate(optimizer, named, tables)
    return translation, translation.spec


def bind(client: Any, named: Sequence[tuple[str, torch.Tensor]], optimizer: Any) -> Translation:
    """The translation ``DistributedOptimizer`` reads each push's values from: ``client.init``'s
    when ``optimizer`` is what it was given, else ``optimizer`` translated now (the tables'
    weights known by identity from ``client.tables.weights``); checked against the shards'
    optimizer (rank 0's). With tables, their PushRows carry the row group's values from now on.

    Raises:
        ValueError: as :func:`translate`; another optimizer or other groups than the shards'.
    """
    opts = as_list(optimizer)
    t = client.translation
    tables = client.tables
    if t is None or [id(o) for o in t.optimizers] != [id(o) for o in opts]:
        weights = {k: ref() for k, ref in (tables.weights.items() if tables is not None else ())}
        t = translate(opts, named, {k: w for k, w in weights.items() if w is not None})
    spec = client.optimizer_spec
    if spec is not None:
        t.check_matches([keys for keys, _ in spec.groups if keys], spec.name)
    if tables is not None and t.row_name is not None:
        in_force = sorted({s.optimizer.name for s in tables.specs.values()})
        if in_force != [t.row_name]:
            raise ValueError(
                f"The tables' optimizer translates to row optimizer {t.row_name}, but the shards run {in_force} "
                "(rank 0's client.init): pass the same optimizers to client.init and DistributedOptimizer."
            )
        tables.hyperparameters = t.row_hyperparameters
    return t


def single(optimizer: Any) -> torch.optim.Optimizer:
    """The one optimizer easgd steps locally (``optimizer`` itself, or a list of one).

    Raises:
        ValueError: a list of several (easgd steps one local optimizer: use param groups).
    """
    opts = as_list(optimizer)
    if len(opts) != 1:
        raise ValueError(
            f"easgd steps one local optimizer; got {len(opts)}: put the parameters in param groups of one optimizer."
        )
    return opts[0]


def shared_groups(optimizer: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The param group dicts of ``optimizer`` (or every optimizer of a list), the objects
    themselves, and the first one's defaults: what ``DistributedOptimizer`` is built on, so an lr
    scheduler on it and one on the user's optimizer set the same values."""
    opts = as_list(optimizer)
    return [g for o in opts for g in o.param_groups], dict(opts[0].defaults)


def mark_stepped(optimizer: Any) -> None:
    """Tell each optimizer's lr schedulers that a step ran (its parameters stepped on the shards,
    or in easgd locally), so torch does not warn that ``scheduler.step()`` came first."""
    for o in as_list(optimizer):
        o._opt_called = True  # the flag torch's LRScheduler patches optimizer.step to set


def keep_groups(optimizer: torch.optim.Optimizer) -> None:
    """Keep ``optimizer.param_groups`` the same dicts across its ``load_state_dict``: torch's puts
    new dicts (the saved groups) in their place; a post hook moves their values into the dicts in
    use before, which ``DistributedOptimizer``, the wrapped optimizer and each push share."""
    groups = optimizer.param_groups
    dicts = list(groups)

    def restore(o: torch.optim.Optimizer) -> None:
        for old, new in zip(dicts, o.param_groups, strict=True):
            if old is not new:  # torch's values, whole: keys the saved group lacks go, as in torch
                values = dict(new)
                old.clear()
                old.update(values)
        groups[:] = dicts
        o.param_groups = groups

    optimizer.register_load_state_dict_post_hook(restore)
