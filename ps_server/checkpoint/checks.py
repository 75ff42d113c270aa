"""Every tensor of a checkpoint state checked against its plan before a shard restores it or
``ps-admin reshard`` cuts it (docs/faults.md, "checkpoints").

A checkpoint's digest proves that the file holds what its writer saved, not that its writer was a
shard: a file crafted with a valid digest (or a release's bug) could hold a partition of another
length or dtype, NaN values, or table rows of another width. Restored as they are, such tensors
train a model that no longer matches the plan every worker computes (a reshard of one cut a
parameter short and trained to accuracy 0.2, exit 0). Here each one is checked against the plan and
refused by name with :class:`~ps_common.errors.CheckpointError`:

- :func:`check_layout`: the state's fields are of the types a shard writes (before any is read);
- :func:`check_tensors`: one 1-D tensor per partition the plan gives the shard, of the partition's
  length and the parameter's dtype, finite; each table's ids (int64, distinct, in range, owned by
  the shard), rows (float32 ``[n, dim]``, finite), row-optimizer state and lifetime stamps;
- :func:`load_optimizer_state`: torch.optim loads the state (its refusal is one line), then
  :func:`check_optimizer_state`: each element-wise tensor is of its partition's length and finite
  (scalars such as Adam's ``step`` are left as they are).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ps_common.codec import torch_dtype
from ps_common.errors import CheckpointError, InvalidRequestError, PSError
from ps_common.optimizer import OptimizerSpec
from ps_common.plan import PartitionSlice, Plan
from ps_common.tables import shard_of
from ps_server.membership.ranks import WorkerState
from ps_server.tables.table_io import spec_from_export

_FIELDS: dict[str, type | tuple[type, ...]] = {
    "plan": dict,
    "tensors": (list, tuple),
    "optimizer": dict,
    "optimizer_state": dict,
    "version": int,
    "mode": str,
    "members": (list, tuple),
}
"""The fields every shard checkpoint state holds, and their types."""

_MEMBER_INTS = ("rank", "incarnation", "clock", "pushes")
_WORKER_STATES = frozenset(s.value for s in WorkerState)

_PLAN_FIELDS: dict[str, type | tuple[type, ...]] = {
    "specs": (list, tuple),
    "num_shards": int,
    "partition_bytes": int,
    "digest": str,
}


def check_layout(state: Any, shard_index: int) -> None:
    """Refuse a state whose fields are missing or of another type than a shard writes.

    Raises:
        CheckpointError: names the field.
    """
    where = f"Shard {shard_index}'s checkpoint"
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{where} holds a {type(state).__name__}, not a state dict.")
    for fields, inside, prefix in ((_FIELDS, state, ""), (_PLAN_FIELDS, state.get("plan"), "plan.")):
        for name, kind in fields.items():
            value = inside.get(name) if isinstance(inside, Mapping) else None
            if not isinstance(value, kind) or isinstance(value, bool):
                got = "nothing" if value is None else type(value).__name__
                raise CheckpointError(f"{where}'s {prefix}{name} is {got}; a shard writes a {_kind(kind)}.")
    optimizer = state["optimizer"]
    if not isinstance(optimizer.get("name"), str) or not isinstance(optimizer.get("kwargs"), Mapping):
        raise CheckpointError(f"{where}'s optimizer has no name and kwargs.")
    for i, spec in enumerate(state["plan"]["specs"]):
        ok = isinstance(spec, (list, tuple)) and len(spec) == 3 and isinstance(spec[0], str)
        if not ok or not isinstance(spec[1], (list, tuple)) or not all(_is_int(d) for d in spec[1]):
            raise CheckpointError(f"{where}'s plan.specs[{i}] is not [key, shape, dtype].")
        if not isinstance(spec[2], str):
            raise CheckpointError(f"{where}'s plan.specs[{i}] ({spec[0][:80]!r}) has no dtype name.")
        try:
            torch_dtype(spec[2])
        except InvalidRequestError:
            raise CheckpointError(f"{where}'s parameter {spec[0][:80]!r} has unknown dtype {spec[2][:20]!r}.") from None
    for r, member in enumerate(state["members"]):
        _check_member(member, r, where)
    tables = state.get("tables")
    if tables is not None and not (isinstance(tables, Mapping) and isinstance(tables.get("tables"), (list, tuple))):
        raise CheckpointError(f"{where}'s tables are not a table export (a dict with a list of tables).")


def check_tensors(state: Mapping[str, Any], plan: Plan, shard_index: int) -> None:
    """Refuse a state whose parameter tensors or table tensors do not fit ``plan``.

    Args:
        state: a checkpoint state that passed :func:`check_layout`.
        plan: the plan its ``plan`` field names (for ``plan.num_shards`` shards).
        shard_index: the shard the state belongs to.

    Raises:
        CheckpointError: names the parameter (key and element range) or the table, and why.
    """
    owned = plan.owned_by(shard_index)
    tensors = state["tensors"]
    if len(tensors) != len(owned):
        raise CheckpointError(
            f"Shard {shard_index}'s checkpoint holds {len(tensors)} parameter tensors, but the plan gives it "
            f"{len(owned)} partitions."
        )
    dtypes = {s.key: torch_dtype(s.dtype) for s in plan.specs}
    _check_optimizer(state["optimizer"], dtypes.values(), shard_index)
    for p, t in zip(owned, tensors, strict=True):
        _check_partition(f"Shard {shard_index}'s checkpoint", p, t, dtypes[p.key])
    for i, table in enumerate((state.get("tables") or {}).get("tables", [])):
        _check_table(table, i, shard_index, plan.num_shards)


def load_optimizer_state(store: Any, saved: Mapping[str, Any]) -> None:
    """Load ``saved`` (torch.optim's ``state_dict``) into ``store``'s optimizer
    (a :class:`~ps_server.shard.store.ParameterStore`), then :func:`check_optimizer_state`.

    Raises:
        CheckpointError: torch.optim refuses ``saved`` (other groups or parameters), or a tensor of
            it does not fit its partition.
    """
    try:
        store.optimizer.load_state_dict(saved)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
        text = str(exc).strip()
        detail = text.splitlines()[0][:160] if text else type(exc).__name__
        shard = f"Shard {store.partitions[0].shard}'s" if store.partitions else "The"
        raise CheckpointError(f"{shard} checkpoint's optimizer state does not load ({detail}).") from None
    check_optimizer_state(store.optimizer.state, store.tensors, store.partitions)


def check_optimizer_state(
    optimizer_state: Mapping[Any, Mapping[str, Any]], tensors: Sequence[torch.Tensor], owned: Sequence[PartitionSlice]
) -> None:
    """Refuse optimizer state (torch.optim's ``state``, keyed by parameter tensor) whose element-wise
    tensors are not of their partition's length, or not finite.

    Args:
        optimizer_state: ``optimizer.state`` after ``load_state_dict``.
        tensors: the shard's partition tensors, plan order; ``owned``: their partitions.

    Raises:
        CheckpointError: names the partition and the state's name.
    """
    for p, t in zip(owned, tensors, strict=True):
        entry = optimizer_state.get(t)
        for name, value in (entry or {}).items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            where = f"Shard {p.shard}'s checkpoint: the optimizer state {str(name)[:40]!r} of {_name(p)}"
            if value.numel() != p.length:
                raise CheckpointError(f"{where} holds {value.numel()} values, not {p.length}.")
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise CheckpointError(f"{where} holds NaN or infinite values.")


def _check_optimizer(saved: Mapping[str, Any], dtypes: Iterable[torch.dtype], shard_index: int) -> None:
    """The optimizer spec a shard builds from ``saved`` (as ``load_state``), in range of ``dtypes``."""
    try:
        groups = tuple((tuple(keys), dict(kw)) for keys, kw in saved.get("groups", []))
        spec = OptimizerSpec(str(saved["name"]), dict(saved["kwargs"]), groups, tuple(saved.get("buffers", [])))
        spec.check_range(dtypes)
    except (PSError, KeyError, TypeError, ValueError) as exc:
        text = str(exc).strip()
        detail = text.splitlines()[0][:200] if text else type(exc).__name__
        raise CheckpointError(f"Shard {shard_index}'s checkpoint's optimizer is refused: {detail}") from None


def _check_partition(where: str, p: PartitionSlice, t: Any, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{where}: {_name(p)} is a {type(t).__name__}, not a tensor.")
    if t.dim() != 1 or t.numel() != p.length:
        raise CheckpointError(
            f"{where}: {_name(p)} holds a tensor of shape {list(t.shape)[:4]}, but the plan's partition is "
            f"[{p.length}]."
        )
    if t.dtype != dtype:
        raise CheckpointError(f"{where}: {_name(p)} is {t.dtype}, but the parameter is {dtype}.")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"{where}: {_name(p)} holds NaN or infinite values.")


def _check_table(table: Any, i: int, shard_index: int, num_shards: int) -> None:
    where = f"Shard {shard_index}'s checkpoint: table {i}"
    spec = table.get("spec") if isinstance(table, Mapping) else None
    try:
        name, num_rows, dim = str(spec["name"])[:80], int(spec["num_rows"]), int(spec["dim"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{where} has no spec (name, num_rows, dim).") from None
    where = f"Shard {shard_index}'s checkpoint: table {name!r}"
    try:
        spec_from_export(table)
    except (PSError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: its spec is refused ({type(exc).__name__}: {str(exc)[:160]}).") from None
    ids, values, state = table.get("ids"), table.get("values"), table.get("state")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64:
        raise CheckpointError(f"{where}: its ids are not a 1-D int64 tensor.")
    n = ids.numel()
    if not isinstance(values, torch.Tensor) or values.dtype != torch.float32 or tuple(values.shape) != (n, dim):
        got = f"{list(values.shape)} {values.dtype}" if isinstance(values, torch.Tensor) else type(values).__name__
        raise CheckpointError(f"{where}: its rows are {got}, not float32 [{n}, {dim}] ({n} ids, dim {dim}).")
    if n and (int(ids.min()) < 0 or int(ids.max()) >= num_rows):
        raise CheckpointError(f"{where}: a row id is out of [0, {num_rows}).")
    if n and int(torch.unique(ids).numel()) != n:
        raise CheckpointError(f"{where}: a row id appears twice.")
    if n and bool((shard_of(ids, num_shards) != shard_index).any()):
        raise CheckpointError(f"{where}: it holds rows another of the {num_shards} shards owns.")
    if not bool(torch.isfinite(values).all()):
        raise CheckpointError(f"{where}: its rows hold NaN or infinite values.")
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{where}: its row-optimizer state is not a dict of tensors.")
    for key, v in state.items():
        if not isinstance(v, torch.Tensor) or v.dim() < 1 or v.shape[0] != n:
            raise CheckpointError(f"{where}: its row-optimizer state {str(key)[:40]!r} is not of {n} rows.")
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise CheckpointError(f"{where}: its row-optimizer state {str(key)[:40]!r} holds NaN or infinite values.")
    life = table.get("life")
    for key in ("step_stamp", "time_stamp") if isinstance(life, Mapping) else ():
        stamp = life.get(key)
        if stamp is not None and (not isinstance(stamp, torch.Tensor) or stamp.numel() != n):
            raise CheckpointError(f"{where}: its row {key}s are not one per row ({n}).")


def _check_member(member: Any, r: int, where: str) -> None:
    if not isinstance(member, Mapping) or not all(_is_int(member.get(f)) for f in _MEMBER_INTS):
        raise CheckpointError(f"{where}'s members[{r}] lacks an int {', '.join(_MEMBER_INTS)}.")
    if member.get("state") not in _WORKER_STATES:
        raise CheckpointError(f"{where}'s members[{r}] has state {str(member.get('state'))[:20]!r}.")
    history = member.get("history", [])
    if not isinstance(history, (list, tuple)) or not all(isinstance(h, (list, tuple)) and len(h) == 7 for h in history):
        raise CheckpointError(f"{where}'s members[{r}] has a history that is not a list of 7-item answers.")


def _name(p: PartitionSlice) -> str:
    return f"parameter {p.key[:80]!r} elements [{p.offset}, {p.offset + p.length})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)
