"""The server optimizer's state in torch's layout: what :meth:`DistributedOptimizer.state_dict
<ps_worker.optimizer.DistributedOptimizer.state_dict>` gathers from the shards and
``load_state_dict`` sends to them (``docs/architecture.md``, optimizer state in checkpoints).

torch's layout: ``{"state": {i: {"step": tensor(), "exp_avg": tensor[param shape], ...}},
"param_groups": [{..., "params": [i, ...]}]}``, parameters numbered in the order of the
optimizer's ``param_groups``. The shards keep each parameter's state per partition (1-D slices
of the flattened parameter, ``ps_common.plan``): a gather puts the slices of every shard back
into tensors of the parameter's shape and dtype (a scalar, e.g. Adam's ``step``, is the one of the
parameter's first partition: every step steps every partition), and a load cuts them again.

Loading is all or nothing across shards: rank 0 stages the state on every shard
(PushOptimizerState; each shard checks every value: owned slice, a name its optimizer keeps,
exact size) and commits it (CommitOptimizerState) only once every shard staged it. A commit
replaces the whole state, so a load that failed between commits (a shard lost mid-way) is
completed by calling ``load_state_dict`` again with the same state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import torch

from ps_common.codec import dtype_from_proto, dtype_name, dtype_to_proto, torch_dtype
from ps_common.errors import PSError
from ps_common.frames import PARTITION_OVERHEAD_BYTES
from ps_proto.v1 import ps_pb2
from ps_worker.errors import error_from_rpc

if TYPE_CHECKING:
    from ps_worker.client import PSClient

log = logging.getLogger(__name__)

RETRY = frozenset({grpc.StatusCode.UNAVAILABLE})

PAIRS = {
    "betas": ("beta1", "beta2"),
    "etas": ("eta_minus", "eta_plus"),
    "step_sizes": ("step_size_min", "step_size_max"),
}
"""torch's tuple hyperparameters and the server spec's names of their halves (``ps_common.optimizer``)."""

State = dict[int, dict[str, torch.Tensor]]
"""torch's ``state``: parameter index -> state name -> tensor."""


def parameter_keys(param_groups: Sequence[Mapping[str, Any]], names: Mapping[int, str]) -> list[str | None]:
    """The key of every parameter in the order torch numbers them (group by group); ``names``: id of
    a parameter tensor -> its key. None: a tensor outside the plan (the weight of an embedding
    table in a wrapped torch optimizer's groups, whose row state the tables keep)."""
    return [names.get(id(p)) for g in param_groups for p in g["params"]]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def gather(client: PSClient, keys: Sequence[str | None]) -> State:
    """The shards' optimizer state of the parameters ``keys`` (in torch's numbering), as torch's
    ``state``: CPU tensors of each parameter's shape and dtype, scalars as the shards keep them.
    A parameter none of whose partitions has state (never stepped) has no entry.

    Raises:
        RuntimeError: not initialized. ShardError: a shard refused the read.
    """
    plan = client.plan
    if plan is None:
        raise RuntimeError("The client is not initialized: call client.init(model, ...) first.")
    parts: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    versions = client.transport.each_shard(lambda k: _pull(client, k, parts))
    if len(set(versions)) > 1:
        log.info("optimizer state read at shard versions %s (async or ssp: the shards move on their own)", versions)
    state: State = {}
    for index, key in enumerate(keys):
        if key is None:  # a table's weight: no dense state
            continue
        spec = plan.spec(key)
        slices = [p for p in plan.partitions if p.key == key]
        found = [parts.get((p.key, p.offset)) for p in slices]
        if not any(found):
            continue
        if not all(found) or len({tuple(f) for f in found if f}) > 1:
            log.warning("parameter %r: its partitions hold different optimizer state names; left out", key)
            continue
        first = found[0]
        assert first is not None
        entry: dict[str, torch.Tensor] = {}
        for name, value in first.items():
            if value.dim() == 0:
                entry[name] = value.clone()
                continue
            full = torch.empty(spec.numel, dtype=torch_dtype(spec.dtype))
            for p, f in zip(slices, found, strict=True):
                assert f is not None
                full[p.offset : p.offset + p.length] = f[name]
            entry[name] = full.reshape(spec.shape)
        state[index] = entry
    return state


def _pull(client: PSClient, k: int, into: dict[tuple[str, int], dict[str, torch.Tensor]]) -> int:
    """PullOptimizerState from shard ``k`` into ``into``; returns the shard's version."""
    session, transport = client.session, client.transport
    request = ps_pb2.PullOptimizerStateRequest(
        rank=session.rank,
        incarnation=session.incarnation,
        session=session.sessions[k],
        plan_digest=client.plan.digest if client.plan else "",
    )

    def once() -> tuple[int, list[ps_pb2.OptimizerStateValue]]:
        values, version = [], 0
        try:
            stream = transport.stubs[k].PullOptimizerState(
                request, timeout=transport.timeout, metadata=transport.metadata
            )
            for msg in stream:
                version = msg.version
                values.extend(msg.values)
        except grpc.RpcError as exc:
            raise error_from_rpc(transport.servers[k], exc) from None
        return version, values

    version, values = transport.policy.call(once, f"PullOptimizerState from shard {k}", codes=RETRY)
    for v in values:
        dtype = torch_dtype(dtype_from_proto(v.dtype))
        t = torch.frombuffer(bytearray(v.data), dtype=dtype) if v.data else torch.empty(0, dtype=dtype)
        into.setdefault((v.key, v.offset), {})[v.name] = t.reshape(()) if v.scalar else t
    return version


# ---------------------------------------------------------------------------------------------- loading
def match_groups(ours: Sequence[Mapping[str, Any]], saved: Sequence[Mapping[str, Any]]) -> list[int | None]:
    """For each of ``ours`` (the optimizer's param_groups), the index of the saved group it takes,
    or None (an empty group of ours that the saved state, e.g. a torch optimizer's, does not have).
    Groups pair in order; when the counts differ, the groups with parameters pair in order.

    Raises:
        ValueError: the groups do not pair (their number, or a pair's number of parameters).
    """
    pairs: list[int | None]
    if len(saved) == len(ours):
        pairs = list(range(len(ours)))
    else:
        full = [i for i, g in enumerate(saved) if g["params"]]
        if len(full) != sum(1 for g in ours if g["params"]):
            raise ValueError(
                f"The state_dict has {len(saved)} parameter groups, but this optimizer has {len(ours)} "
                f"({[len(g['params']) for g in ours]} parameters); save and load with the same groups."
            )
        it = iter(full)
        pairs = [next(it) if g["params"] else None for g in ours]
    for g, s in zip(ours, pairs, strict=True):
        if s is not None and len(saved[s]["params"]) != len(g["params"]):
            raise ValueError(
                f"Parameter group {s} of the state_dict has {len(saved[s]['params'])} parameters, but this "
                f"optimizer's has {len(g['params'])}; save and load with the same model and groups."
            )
    return pairs


def loaded_groups(
    ours: Sequence[Mapping[str, Any]], saved: Sequence[Mapping[str, Any]], pairs: list[int | None]
) -> list[dict[str, Any]]:
    """The param_groups to hand to torch's ``load_state_dict``: each of ours with the saved group's
    values (its parameter numbers), torch's tuples also under the server's names (``betas`` ->
    ``beta1``, ``beta2``...), so pushes carry them."""
    out = []
    for g, s in zip(ours, pairs, strict=True):
        group = {k: v for k, v in g.items() if k != "params"}
        if s is not None:
            group.update(saved[s])
            for pair, (a, b) in PAIRS.items():
                if pair in saved[s] and a in g:
                    group[a], group[b] = (float(x) for x in saved[s][pair])
        else:
            group["params"] = []
        out.append(group)
    return out


def cut(
    client: PSClient,
    keys: Sequence[str | None],
    saved_groups: Sequence[Mapping[str, Any]],
    pairs: list[int | None],
    state: Any,
) -> list[list[ps_pb2.OptimizerStateValue]]:
    """Check torch's ``state`` against the model and cut it into each shard's partition values.

    Raises:
        ValueError: a parameter number the groups do not have, a value that is not a tensor, a
            tensor neither scalar nor of its parameter's shape.
    """
    plan = client.plan
    assert plan is not None
    numbers = [n for s in pairs if s is not None for n in saved_groups[s]["params"]]
    key_of = dict(zip(numbers, keys, strict=True))
    out: list[list[ps_pb2.OptimizerStateValue]] = [[] for _ in range(plan.num_shards)]
    if not isinstance(state, Mapping):
        raise ValueError(
            f"state_dict['state'] must be a dict of parameter number -> state, got {type(state).__name__}."
        )
    for number, entry in state.items():
        if number not in key_of:
            raise ValueError(f"state_dict['state'] has parameter {number!r}, which no parameter group lists.")
        key = key_of[number]
        if key is None:  # an embedding table's weight: its row state is the tables' (their checkpoints)
            continue
        spec = plan.spec(key)
        if not isinstance(entry, Mapping):
            raise ValueError(f"The state of parameter {number} ({key}) must be a dict, got {type(entry).__name__}.")
        for name, value in entry.items():
            if value is None:  # torch's SGD without momentum keeps momentum_buffer None: no state
                continue
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise ValueError(
                    f"State {name!r} of parameter {number} ({key}) is {type(value).__name__}, not a float tensor; "
                    "the shards keep tensor state only."
                )
            value = value.detach().cpu()
            if value.dim() != 0 and tuple(value.shape) != spec.shape:
                raise ValueError(
                    f"State {name!r} of parameter {number} ({key}) has shape {tuple(value.shape)}, but the parameter "
                    f"has {spec.shape}; is the state_dict of another model?"
                )
            flat = value if value.dim() == 0 else value.to(torch_dtype(spec.dtype)).reshape(-1)
            for p in (p for p in plan.partitions if p.key == key):
                data = flat if value.dim() == 0 else flat[p.offset : p.offset + p.length]
                out[p.shard].append(
                    ps_pb2.OptimizerStateValue(
                        key=key,
                        offset=p.offset,
                        name=str(name),
                        dtype=dtype_to_proto(dtype_name(data.dtype)),
                        scalar=value.dim() == 0,
                        data=_tensor_bytes(data),
                    )
                )
    return out


def push(client: PSClient, values: list[list[ps_pb2.OptimizerStateValue]]) -> None:
    """Stage ``values`` (per shard) on every shard, then, once every shard staged, commit them.

    Raises:
        ShardError: a shard refused its values (INVALID_ARGUMENT: they do not fit its optimizer;
            nothing was applied anywhere), or a commit failed (the message names the shards that
            committed; loading the same state again completes the load).
    """
    stages = client.transport.each_shard(lambda k: _stage(client, k, values[k]))
    done: list[int] = []
    failed: list[tuple[int, PSError]] = []
    for k, stage in enumerate(stages):
        try:
            _commit(client, k, stage)
            done.append(k)
        except PSError as exc:
            failed.append((k, exc))
    if failed:
        k, exc = failed[0]
        log.error(
            "optimizer state committed on shards %s but not on %s (%s); load the same state_dict again to "
            "complete the load (a load replaces the whole state)",
            done,
            [k for k, _ in failed],
            exc.details(),
        )
        raise exc


def _messages(client: PSClient, k: int, values: list[ps_pb2.OptimizerStateValue]) -> Iterator[Any]:
    """PushOptimizerState's messages to shard ``k``: the header, then ``values`` packed up to
    ``partition_bytes`` each (or one value: at most a partition's bytes)."""
    session = client.session
    msg = ps_pb2.PushOptimizerStateRequest(
        rank=session.rank,
        incarnation=session.incarnation,
        session=session.sessions[k],
        plan_digest=client.plan.digest if client.plan else "",
    )
    budget, used = client.partition_bytes, 0
    for v in values:
        size = len(v.data) + len(v.key) + len(v.name) + PARTITION_OVERHEAD_BYTES
        if msg.values and used + size > budget:
            yield msg
            msg, used = ps_pb2.PushOptimizerStateRequest(), 0
        msg.values.append(v)
        used += size
    yield msg


def _stage(client: PSClient, k: int, values: list[ps_pb2.OptimizerStateValue]) -> int:
    transport = client.transport

    def once() -> int:
        try:
            answer = transport.stubs[k].PushOptimizerState(
                _messages(client, k, values), timeout=transport.timeout, metadata=transport.metadata
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(transport.servers[k], exc) from None
        return answer.stage

    return transport.policy.call(once, f"PushOptimizerState to shard {k}", codes=RETRY)


def _commit(client: PSClient, k: int, stage: int) -> None:
    transport, session = client.transport, client.session
    request = ps_pb2.CommitOptimizerStateRequest(
        rank=session.rank, incarnation=session.incarnation, session=session.sessions[k], stage=stage
    )
    try:
        transport.stubs[k].CommitOptimizerState(request, timeout=transport.timeout, metadata=transport.metadata)
    except grpc.RpcError as exc:
        raise error_from_rpc(transport.servers[k], exc) from None


# ---------------------------------------------------------------------------------------------- the optimizer's side
def state_of(opt: Any) -> State:
    """The server optimizer's state of ``opt`` (a ``DistributedOptimizer``) in torch's numbering;
    empty when its mode keeps none on the shards (easgd: the local optimizer holds it)."""
    if opt.client.worker_mode.local_optimizer:
        return {}
    names = {id(p): k for k, p in opt.params.items()}
    return gather(opt.client, parameter_keys(opt.param_groups, names))


def load(opt: Any, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Check torch's ``state_dict`` against ``opt`` (a ``DistributedOptimizer``) and its plan, and,
    on rank 0, load its ``state`` into the shards (every rank runs the same script: one push is
    enough, and the other ranks' would only repeat it); returns what torch's own
    ``load_state_dict`` then takes (the groups aligned with ``opt``'s, no local state).

    Raises:
        ValueError: the state_dict does not fit (groups, parameter numbers, shapes; a state under
            easgd, whose state is the local optimizer's). ShardError: a shard refused it
            (INVALID_ARGUMENT: e.g. another optimizer class's state names); nothing was applied.
    """
    saved = state_dict.get("param_groups")
    if not isinstance(saved, Sequence) or not all(isinstance(g, Mapping) and "params" in g for g in saved):
        raise ValueError("state_dict['param_groups'] must be a list of groups, each with 'params'.")
    pairs = match_groups(opt.param_groups, saved)
    state = state_dict.get("state") or {}
    if state and opt.client.worker_mode.local_optimizer:
        raise ValueError(
            "This cluster runs easgd: the optimizer state is local_optimizer's; load it there "
            "(DistributedOptimizer.state_dict() keeps it under 'ps')."
        )
    if not opt.client.worker_mode.local_optimizer:
        names = {id(p): k for k, p in opt.params.items()}
        values = cut(opt.client, parameter_keys(opt.param_groups, names), saved, pairs, state)
        if opt.client.rank == 0:
            push(opt.client, values)
    return {"state": {}, "param_groups": loaded_groups(opt.param_groups, saved, pairs)}
