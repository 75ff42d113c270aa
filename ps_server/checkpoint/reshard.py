"""Reshard one checkpoint set: the states of S shards at one version -> the states of N shards
(docs/architecture.md#14-checkpoints). Pure: states in, states out; reading and writing the files is
:mod:`ps_server.checkpoint.reshard_cli`.

What moves and how:

- **parameters**: each parameter is put back together from the old partitions, then cut by
  :func:`ps_common.plan.make_plan` for N shards (the function every shard and worker uses), so the
  new files carry the digest of the plan workers compute for N shards;
- **optimizer state**: torch.optim keeps it per partition tensor (element-wise tensors of the
  partition's length, and scalars such as Adam's ``step``); element-wise tensors are joined and cut
  like the parameters; a new partition's scalar is that of the old partitions it covers, which must
  agree (they do in a job where every partition steps each update); the parameter groups'
  hyperparameters (a learning rate a worker or an operator set) are shard 0's;
- **embedding tables**: held rows (ids, values, row-optimizer state, lifetime stamps) go to the new owner of each id,
  ``ps_common.tables.shard_of(ids, N)``; a table's step and round must agree on every old shard;
- **version, mode, members, membership epochs, worker count**: shard 0's; the members' exactly-once
  marks (incarnation, clock, high-water mark) must agree on every old shard, which they do at a
  version every shard checkpointed in sync mode, so every new shard refuses exactly the replays
  every old shard refused (each new partition was updated by precisely those pushes).

Anything the old shards disagree on is refused with :class:`ReshardError`: the result would not be
one consistent point of the job.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from ps_common.codec import torch_dtype
from ps_common.errors import CheckpointError, PSError
from ps_common.plan import Plan, make_plan
from ps_common.tables import shard_of
from ps_server.checkpoint.checks import check_layout
from ps_server.shard.state import load_state
from ps_server.shard.store import ParameterStore

MAX_SHARDS = 4096
"""Most shards ``ps-admin reshard --to`` plans for: a bound on what one plan, and one set of
checkpoint files, holds (the plan of 10^9 shards took 5.3 GB before it was refused)."""

MEMBER_MARKS = ("incarnation", "clock", "high_water")
"""A member's fields every old shard must agree on: what makes a push exactly-once."""


class ReshardError(CheckpointError):
    """The checkpoint set cannot be resharded (mixed, inconsistent or corrupt); nothing was written."""


def reshard_states(states: Sequence[dict[str, Any]], num_shards: int) -> list[dict[str, Any]]:
    """The states of ``num_shards`` shards equal to the checkpoint set ``states`` (shard order, all
    at one version), each as :meth:`ps_server.shard.shard.Shard.export_state` writes it.

    Args:
        states: the ``state`` of every old shard's checkpoint envelope, shard ``k`` at index ``k``.
        num_shards: the new shard count, >= 1.

    Returns:
        One state per new shard, in shard order (tensors are new: the inputs are not changed).

    Raises:
        ReshardError: ``num_shards`` < 1, or the states are not one consistent set (another plan,
            version, mode or member marks on some shard, optimizer scalars that disagree).
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ReshardError(f"The new shard count must be an int >= 1, got {num_shards!r}.")
    if not states:
        raise ReshardError("No checkpoint states to reshard.")
    old_count = len(states)
    first = states[0]
    for k, st in enumerate(states):
        try:
            check_layout(st, k)
        except CheckpointError as exc:
            raise ReshardError(f"{exc} Nothing was written.") from None
        for field in ("version", "mode"):
            if st[field] != first[field]:
                raise ReshardError(f"Shard {k} has {field} {st[field]!r} but shard 0 has {first[field]!r}.")
        if st["plan"] != first["plan"]:
            raise ReshardError(f"Shard {k}'s plan differs from shard 0's: the files are not of one job.")
        ours, theirs = _cluster_id(first), _cluster_id(st)
        if ours and theirs and ours != theirs:
            raise ReshardError(f"Shard {k}'s checkpoint is of another job (cluster id {theirs}, shard 0's {ours}).")
    try:  # every tensor checked against the plan (ps_server.checkpoint.checks)
        loaded = [load_state(st, k, old_count) for k, st in enumerate(states)]
    except PSError as exc:
        raise ReshardError(f"The checkpoint set does not load: {exc}") from exc
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:  # torch.optim's load_state_dict
        detail = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        raise ReshardError(f"The checkpoint set does not load: {type(exc).__name__}: {detail}") from None
    old_plan = loaded[0][0]
    check_shard_count(old_plan, num_shards, states)
    stores = [store for _, store in loaded]
    members = _members(states)
    new_plan = make_plan(old_plan.specs, num_shards, old_plan.partition_bytes)
    values = _whole(old_plan, [s.tensors for s in stores])
    opt_state = _whole_state(old_plan, stores)
    tables = _tables(states, num_shards) if any(st.get("tables") for st in states) else None
    out = []
    for k in range(num_shards):
        owned = new_plan.owned_by(k)
        store = ParameterStore(
            new_plan, k, [values[p.key][p.offset : p.offset + p.length] for p in owned], stores[0].optimizer_spec
        )
        store.replace_state(_partition_state(opt_state, store))
        for new_group, old_group in zip(store.optimizer.param_groups, stores[0].optimizer.param_groups, strict=True):
            new_group.update({key: copy.deepcopy(v) for key, v in old_group.items() if key != "params"})
        state = {key: copy.deepcopy(v) for key, v in first.items() if key not in ("tensors", "optimizer_state")}
        state["plan"] = _plan_info(new_plan)
        state["tensors"] = [t.detach().clone() for t in store.tensors]
        state["optimizer_state"] = copy.deepcopy(store.optimizer.state_dict())
        state["members"] = copy.deepcopy(members)
        state.pop("tables", None)
        if tables is not None:
            state["tables"] = tables[k]
        out.append(state)
    return out


def check_shard_count(plan: Plan, num_shards: int, states: Sequence[dict[str, Any]] = ()) -> None:
    """Refuse, before any planning, a shard count no cluster of this job can use: above
    :data:`MAX_SHARDS`, or above what the job holds (each new shard needs a parameter element or a
    table row of its own: one of more shards would hold nothing).

    Raises:
        ReshardError: ``num_shards`` is too large, naming the bound.
    """
    elements = sum(s.numel for s in plan.specs)
    rows = sum(int(t["ids"].numel()) for st in states for t in (st.get("tables") or {}).get("tables", []))
    most = min(MAX_SHARDS, max(elements, rows))
    if num_shards > most:
        why = (
            f"this job holds {elements} parameter elements and {rows} table rows"
            if most < MAX_SHARDS
            else (f"a plan holds at most {MAX_SHARDS} shards")
        )
        raise ReshardError(f"Cannot reshard onto {num_shards} shards: {why}; give --to at most {most}.")


def _cluster_id(state: dict[str, Any]) -> str:
    """The cluster id a shard's checkpoint names ("" when it names none: an earlier release)."""
    return str((state.get("epochs") or {}).get("cluster_id", ""))


def _plan_info(plan: Plan) -> dict[str, Any]:
    return {
        "specs": [[sp.key, list(sp.shape), sp.dtype] for sp in plan.specs],
        "num_shards": plan.num_shards,
        "partition_bytes": plan.partition_bytes,
        "digest": plan.digest,
    }


def _members(states: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Shard 0's members, once every shard agrees on each rank's exactly-once marks."""
    first = states[0]["members"]
    for k, st in enumerate(states):
        if len(st["members"]) != len(first):
            raise ReshardError(f"Shard {k} lists {len(st['members'])} ranks but shard 0 lists {len(first)}.")
        for a, b in zip(first, st["members"], strict=True):
            theirs, ours = [b.get(f, -1) for f in MEMBER_MARKS], [a.get(f, -1) for f in MEMBER_MARKS]
            if theirs != ours:
                raise ReshardError(
                    f"Rank {a['rank']} has (incarnation, clock, high-water) {tuple(theirs)} on shard {k} but "
                    f"{tuple(ours)} on shard 0: the shards did not apply the same pushes at this version. "
                    "Reshard a version every shard checkpointed in sync mode, or the final checkpoints of a job "
                    "whose workers finished."
                )
    return copy.deepcopy(first)


def _whole(plan: Plan, per_shard: Sequence[Sequence[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every parameter flattened, put together from the shards' partitions (1-D, its dtype)."""
    whole = {s.key: torch.empty(s.numel, dtype=torch_dtype(s.dtype)) for s in plan.specs}
    for k, tensors in enumerate(per_shard):
        for p, t in zip(plan.owned_by(k), tensors, strict=True):
            whole[p.key][p.offset : p.offset + p.length] = t
    return whole


# key -> list of (offset, length, state of that old partition or None)
_Pieces = dict[str, list[tuple[int, int, dict[str, torch.Tensor] | None]]]


def _whole_state(plan: Plan, stores: Sequence[ParameterStore]) -> _Pieces:
    """The optimizer state of every trained old partition, by parameter key, offset order."""
    pieces: _Pieces = {}
    for k, store in enumerate(stores):
        owned = plan.owned_by(k)
        for i in store.trained_index:
            entry = store.optimizer.state.get(store.tensors[i])
            kept = {n: v for n, v in entry.items() if isinstance(v, torch.Tensor)} if entry else None
            pieces.setdefault(owned[i].key, []).append((owned[i].offset, owned[i].length, kept))
    for parts in pieces.values():
        parts.sort(key=lambda piece: piece[0])
    return pieces


def _partition_state(pieces: _Pieces, store: ParameterStore) -> dict[int, dict[str, torch.Tensor]]:
    """The state of each trained partition of the new ``store`` (index -> name -> tensor): element-wise
    tensors cut from the old pieces it overlaps, scalars shared by them."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for i in store.trained_index:
        p = store.partitions[i]
        end = p.offset + p.length
        covering = [(o, n, s) for o, n, s in pieces.get(p.key, []) if o < end and o + n > p.offset]
        have = [s is not None for _, _, s in covering]
        if not any(have):
            continue
        names = {frozenset(s) for _, _, s in covering if s is not None}
        if not all(have) or len(names) != 1:
            raise ReshardError(
                f"Parameter {p.key!r}: its old partitions over elements [{p.offset}, {end}) hold different "
                "optimizer state (some stepped, some not); they cannot form one partition."
            )
        entry: dict[str, torch.Tensor] = {}
        for name in next(s for _, _, s in covering if s is not None):  # torch's order of the names
            values = [(o, n, s[name]) for o, n, s in covering if s is not None]
            if values[0][2].dim() == 0:
                if any(not torch.equal(v, values[0][2]) for _, _, v in values):
                    raise ReshardError(
                        f"Parameter {p.key!r}: optimizer state {name!r} differs between its old partitions "
                        f"over elements [{p.offset}, {end}); they cannot form one partition."
                    )
                entry[name] = values[0][2].clone()
            else:
                cut = [v[max(p.offset, o) - o : min(end, o + n) - o] for o, n, v in values]
                entry[name] = torch.cat(cut).clone()
        out[i] = entry
    return out


def _tables(states: Sequence[dict[str, Any]], num_shards: int) -> list[dict[str, Any]]:
    """The tables of each new shard: held rows moved to ``shard_of(id, num_shards)``; the table
    round, each table's step and spec must agree on every old shard; per-rank high-water marks of
    immediate row pushes are the highest any old shard holds (so no new shard applies a push again)."""
    saved = [st.get("tables") or {"version": 0, "tables": [], "high_water": [], "hyperparameters": {}} for st in states]
    first = saved[0]
    marks: dict[int, tuple[int, int]] = {}
    for k, s in enumerate(saved):
        if s["version"] != first["version"]:
            raise ReshardError(f"Shard {k} is at table round {s['version']} but shard 0 at {first['version']}.")
        if [t["spec"] for t in s["tables"]] != [t["spec"] for t in first["tables"]]:
            raise ReshardError(f"Shard {k} holds other embedding tables than shard 0.")
        for rank, inc, clock in s.get("high_water", []):
            marks[int(rank)] = max(marks.get(int(rank), (-1, -1)), (int(inc), int(clock)))
    out = [
        {
            "version": first["version"],
            "tables": [],
            "high_water": [[r, inc, clock] for r, (inc, clock) in sorted(marks.items())],
            "hyperparameters": dict(first.get("hyperparameters", {})),
        }
        for _ in range(num_shards)
    ]
    for t, table in enumerate(first["tables"]):
        parts = [s["tables"][t] for s in saved]
        if any(p["step"] != table["step"] for p in parts):
            raise ReshardError(f"Table {table['spec']['name']!r} has another step on some shard than on shard 0.")
        ids = torch.cat([p["ids"].to(torch.int64) for p in parts])
        values = torch.cat([p["values"] for p in parts])
        names = sorted(table["state"])
        state = {n: torch.cat([p["state"][n] for p in parts]) for n in names}
        order = torch.argsort(ids)
        ids, values, state = ids[order], values[order], {n: v[order] for n, v in state.items()}
        lives = [p.get("life") for p in parts]
        owner = shard_of(ids, num_shards)
        for k in range(num_shards):
            mine = owner == k
            moved = {
                "spec": copy.deepcopy(table["spec"]),
                "ids": ids[mine].clone(),
                "values": values[mine].clone(),
                "state": {n: v[mine].clone() for n, v in state.items()},
                "step": table["step"],
            }
            if all(life is not None for life in lives):
                moved["life"] = _life(lives, order, mine, first_shard=k == 0)
            out[k]["tables"].append(moved)
    return out


def _life(lives: Sequence[dict[str, Any]], order: torch.Tensor, mine: torch.Tensor, first_shard: bool) -> dict:
    """A table's row lifetimes on one new shard: each row's stamps move with it; the admission
    filter is the cell-wise sum of the old shards' count-min sketches (a valid sketch of all their
    ids: no estimate drops; folded to the narrowest width, ``AdmissionFilter.restore`` fits it);
    rotation as on shard 0; the admitted and evicted counts, summed, on new shard 0."""
    head = lives[0]
    out = {key: torch.cat([life[key] for life in lives])[order][mine].clone() for key in ("step_stamp", "time_stamp")}
    out["filter"] = {}
    for generation in ("current", "previous"):
        sketches = [(life.get("filter") or {}).get(generation) for life in lives]
        if any(s is None for s in sketches):
            continue
        width = min(int(s.shape[1]) for s in sketches)
        total = sum(s.to(torch.int64).reshape(s.shape[0], -1, width).sum(1) for s in sketches)
        out["filter"][generation] = torch.as_tensor(total).clamp(max=255).to(torch.uint8)
    out["rotated_step"], out["rotated_at"] = head.get("rotated_step", 0), head.get("rotated_at", 0.0)
    for key in ("admitted", "evicted_expired", "evicted_lru"):
        out[key] = sum(int(life.get(key, 0)) for life in lives) if first_shard else 0
    return out
