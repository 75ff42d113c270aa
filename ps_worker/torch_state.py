"""The state a script loads into its own torch optimizer, sent to the shards: a DDP script resumes
with ``optimizer.load_state_dict(checkpoint["optimizer"])`` before it builds the client (imagenet's,
nanoGPT's order) or after; either way the moments reach the shards, as
``DistributedOptimizer.load_state_dict`` sends them (:mod:`ps_worker.optimizer_state`), and the
group dicts that pushes read stay the ones in use (:func:`ps_worker.optim_wrap.keep_groups`). Its
``state_dict()`` then holds the shards' state, as the DistributedOptimizer's does.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ps_proto.v1 import ps_pb2
from ps_worker.optim_wrap import keep_groups
from ps_worker.optimizer_state import cut, gather, parameter_keys, push
from ps_worker.torch_optim import as_list

if TYPE_CHECKING:
    from ps_worker.client import PSClient

log = logging.getLogger(__name__)

ADOPTED: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
"""Torch optimizer -> the client whose shards hold its state (its hooks are registered once)."""


def send_torch_state(
    client: PSClient, named: Sequence[tuple[str, torch.Tensor]], optimizers: Sequence[Any], what: str
) -> None:
    """The state that torch ``optimizers`` hold (loaded from a checkpoint into the script's own
    optimizer), in one load: rank 0 sends it to the shards (:func:`~ps_worker.optimizer_state.push`:
    all or nothing, replacing the shards' state); every rank then drops its copy (the optimizer never
    steps: the shards do).

    Args:
        named: the model's dense parameters (key, tensor); a tensor outside them (a sparse table's
            weight) has no dense state here: its row state is the tables' (their checkpoints).
        what: where the state was found, for the log.

    Raises:
        ValueError: a state value that is not a tensor of its parameter's shape
            (:func:`~ps_worker.optimizer_state.cut`).
        ShardError: a shard refused it (INVALID_ARGUMENT); nothing was loaded.
    """
    held = [o for o in optimizers if any(o.state.values())]
    if not held or client.plan is None:
        return
    names = {id(p): k for k, p in named}
    values: list[list[ps_pb2.OptimizerStateValue]] = [[] for _ in range(client.plan.num_shards)]
    for o in held:
        saved = o.state_dict()
        keys = parameter_keys(o.param_groups, names)
        tables = sum(1 for i, k in enumerate(keys) if k is None and i in saved["state"])
        if tables:
            log.warning(
                "%s: the state of %d sparse table weights in %s is not loaded: the tables keep their row state in "
                "the shards' checkpoints",
                what,
                tables,
                type(o).__name__,
            )
        pairs: list[int | None] = list(range(len(saved["param_groups"])))
        for k, part in enumerate(cut(client, keys, saved["param_groups"], pairs, saved["state"])):
            values[k].extend(part)
    if client.rank == 0 and any(values):
        push(client, values)
        log.info("%s: the torch optimizer's state went to the shards (%d values)", what, sum(map(len, values)))
    for o in held:
        o.state.clear()


def adopt(opt: Any, wrapped: Any) -> None:
    """Tie ``opt`` (a ``DistributedOptimizer``, being built) and the torch optimizers it wraps and
    ``client.init`` was given to the shards across loads: state they hold (a DDP script's
    ``optimizer.load_state_dict(checkpoint["optimizer"])`` before the client) goes to the shards
    now, and so does the state of any later load into them (:func:`send_torch_state`, rank 0);
    every ``load_state_dict`` keeps the group dicts the pushes read (:func:`~ps_worker.optim_wrap.keep_groups`),
    and their ``state_dict()`` holds the shards' state (:func:`shards_state`).
    easgd, diloco: the wrapped optimizer steps locally and keeps its state.

    Raises:
        ValueError, ShardError: as :func:`send_torch_state`.
    """
    keep_groups(opt)
    translated = opt.client.translation.optimizers if opt.client.translation is not None else []
    optimizers = {id(o): o for o in [*(as_list(wrapped) if wrapped is not None else []), *translated]}.values()
    named = list(opt.params.items())
    local = opt.client.worker_mode.local_optimizer
    if not local:
        send_torch_state(opt.client, named, list(optimizers), "the torch optimizer given to client.init")
    for o in optimizers:
        if ADOPTED.get(o) is opt.client:
            continue  # a second DistributedOptimizer over it: hooked once
        ADOPTED[o] = opt.client
        keep_groups(o)
        if not local:
            o.register_load_state_dict_post_hook(
                lambda o: send_torch_state(opt.client, named, [o], f"{type(o).__name__}.load_state_dict")
            )
            o.register_state_dict_post_hook(lambda o, saved: shards_state(opt.client, named, o, saved))


def shards_state(client: PSClient, named: Sequence[tuple[str, torch.Tensor]], o: Any, saved: dict) -> dict:
    """``o.state_dict()`` of a wrapped torch optimizer: its ``state`` is the shards' (read from every
    shard, in ``o``'s numbering, as ``DistributedOptimizer.state_dict`` reads it), so a script that
    saves ``optimizer.state_dict()`` of its own optimizer saves the moments. While ``o`` holds state
    of its own (a load being sent), that state."""
    if any(o.state.values()):
        return saved
    names = {id(p): k for k, p in named}
    return {**saved, "state": gather(client, parameter_keys(o.param_groups, names))}
