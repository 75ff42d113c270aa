"""A shard's server-optimizer state per owned partition, as torch.optim keeps it: read
(PullOptimizerState), staged whole once every value is checked (PushOptimizerState), and put in
force all at once (CommitOptimizerState). See ``docs/architecture.md`` (optimizer state in checkpoints).

Loading is two-phase so that a state any shard refuses is applied by none: the worker stages the
state on every shard first (each checks every value against its plan and optimizer, holding
nothing else), and commits only once every shard staged. A commit replaces the whole state of
every trained partition (a partition the stage gives no state to has none, as before its first
step), so committing the same stage again, or loading the same state again, changes nothing more.

:class:`StateIntake` checks the values of a request as they arrive, without the shard's lock;
:class:`OptimizerStates` (the shard's collaborator) reads, stages and commits under it.
"""

from __future__ import annotations

import functools
import secrets
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ps_common.codec import check_finite, decode, dtype_from_proto
from ps_common.errors import InvalidRequestError, NotInitializedError, PreconditionError
from ps_common.plan import Plan
from ps_server.shard.data import DataHost
from ps_server.shard.store import ParameterStore


@dataclass(frozen=True)
class StateValue:
    """One state value of one partition: ``tensor`` is 1-D of the partition's length, or 0-d (``scalar``)."""

    key: str
    offset: int
    name: str
    tensor: torch.Tensor

    @property
    def scalar(self) -> bool:
        return self.tensor.dim() == 0


@functools.lru_cache(maxsize=64)
def _probe(cls: type[torch.optim.Optimizer], hyper: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, bool], ...]:
    probe = torch.zeros(2, requires_grad=True)
    opt = cls([{"params": [probe], **dict(hyper)}])
    eager = ("", bool(opt.state.get(probe)))  # state before any step (Adagrad's): every parameter has it
    probe.grad = torch.zeros(2)
    with torch.no_grad():
        opt.step()
    state = opt.state[probe]
    return (eager, *((k, v.dim() == 0) for k, v in state.items() if isinstance(v, torch.Tensor)))


def state_names(optimizer: torch.optim.Optimizer, group: int) -> dict[str, bool]:
    """The names of the state ``optimizer`` keeps per parameter of ``group`` once it stepped,
    name -> whether it is a scalar (0-d, e.g. Adam's ``step``) rather than of the parameter's shape.
    Found by stepping a copy of the optimizer's class and the group's hyperparameters once over a
    2-element probe with a zero gradient (e.g. SGD: ``momentum_buffer`` only with momentum; Adam:
    ``max_exp_avg_sq`` only with amsgrad), cached per class and hyperparameters. The name ``""``
    says whether the optimizer creates the state before any step (Adagrad): then every parameter
    must have it."""
    hyper = tuple(sorted((k, v) for k, v in optimizer.param_groups[group].items() if k != "params"))
    try:
        return dict(_probe(type(optimizer), hyper))
    except TypeError:  # a value that cannot be a cache key
        return dict(_probe.__wrapped__(type(optimizer), hyper))


class Layout:
    """What state each owned partition of ``store`` takes: ``names[i]`` (name -> scalar) for a
    trained partition ``i`` (plan order among the shard's), None for a buffer partition."""

    def __init__(self, plan: Plan, shard_index: int, store: ParameterStore) -> None:
        self.plan, self.shard_index, self.store = plan, shard_index, store
        group_of = {id(t): g for g, group in enumerate(store.optimizer.param_groups) for t in group["params"]}
        names: list[dict[str, bool] | None] = [None] * len(store.partitions)
        self.eager: set[int] = set()
        """Trained partitions whose state must be given (the optimizer creates it before any step)."""
        for i in store.trained_index:
            found = state_names(store.optimizer, group_of[id(store.tensors[i])])
            if found.pop(""):
                self.eager.add(i)
            names[i] = found
        self.names = names
        self.values = sum(len(n) for n in names if n)
        """The most values a state may carry (every trained partition's every name)."""


class StateIntake:
    """The values of one PushOptimizerState, each checked as it arrives (no lock: ``layout`` is
    read-only): a partition this shard owns and trains, a name its optimizer keeps, a scalar or
    exactly the partition's length, the parameter's dtype (a scalar: any float dtype), finite, not
    sent before. The values a state may carry bound the request: every value is distinct and of
    a fixed size, so it holds at most (names x partition bytes) per partition.

    Raises (from :meth:`add` and :meth:`finish`):
        InvalidRequestError: a value that does not fit, as above; a partition given some of its
            optimizer's state names but not all.
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.index = layout.plan.index_of(layout.shard_index)
        self.staged: dict[int, dict[str, torch.Tensor]] = {}
        self.count = 0

    def add(self, msg: Any) -> None:
        """Check and keep one ``ps.v1.OptimizerStateValue``."""
        where = f"optimizer state {msg.name[:40]!r} of partition ({msg.key[:80]!r}, {msg.offset})"
        i = self.index.get((msg.key, msg.offset))
        if i is None:
            raise InvalidRequestError(
                f"The {where} names no partition of shard {self.layout.shard_index}; send each partition's state to "
                "the shard that owns it (the plan's)."
            )
        names = self.layout.names[i]
        if names is None:
            raise InvalidRequestError(f"The {where} is of a buffer; buffers have no optimizer state.")
        if msg.name not in names:
            raise InvalidRequestError(
                f"The {where} is not one {type(self.layout.store.optimizer).__name__} keeps; it keeps "
                f"{', '.join(sorted(names))} (is the state of another optimizer class or settings?)."
            )
        if msg.scalar != names[msg.name]:
            raise InvalidRequestError(
                f"The {where} must be {'a scalar' if names[msg.name] else 'of the parameter shape'}."
            )
        dtype = dtype_from_proto(msg.dtype)
        part = self.layout.store.partitions[i]
        own = self.layout.plan.dtypes[part.key]
        if not msg.scalar and dtype != own:
            raise InvalidRequestError(f"The {where} is {dtype}, but the parameter is {own}; send it as {own}.")
        entry = self.staged.setdefault(i, {})
        if msg.name in entry:
            raise InvalidRequestError(f"The {where} came twice; send each value once.")
        self.count += 1
        if self.count > self.layout.values:
            raise InvalidRequestError(f"The state carries more than the {self.layout.values} values it can.")
        tensor = decode(msg.data, dtype, 1 if msg.scalar else part.length).clone()
        check_finite(tensor, where)
        entry[msg.name] = tensor.reshape(()) if msg.scalar else tensor

    def finish(self) -> dict[int, dict[str, torch.Tensor]]:
        """The staged state, partition index -> name -> tensor, once every partition given state
        has all of its names (and every partition has state, for an optimizer that keeps it from
        the start)."""
        absent = sorted(self.layout.eager - set(self.staged))
        if absent:
            part = self.layout.store.partitions[absent[0]]
            raise InvalidRequestError(
                f"Partition ({part.key[:80]!r}, {part.offset}) has no optimizer state, but "
                f"{type(self.layout.store.optimizer).__name__} keeps state for every parameter from the start."
            )
        for i, entry in self.staged.items():
            names = self.layout.names[i] or {}
            missing = sorted(set(names) - set(entry))
            if missing:
                part = self.layout.store.partitions[i]
                raise InvalidRequestError(
                    f"Partition ({part.key[:80]!r}, {part.offset}) has optimizer state {', '.join(sorted(entry))} but "
                    f"not {', '.join(missing)}; send all of its state or none."
                )
        return self.staged


@dataclass
class Stage:
    """A checked state waiting for its commit: for ``store`` (a re-init or restore voids it)."""

    stage: int
    store: ParameterStore
    state: dict[int, dict[str, torch.Tensor]]


class OptimizerStates:
    """Reads, stages and commits the server optimizer's state of one shard; every method takes the
    shard's lock ``cond``. One stage is kept at a time: a later push replaces it."""

    def __init__(self, host: DataHost, cond: threading.Condition) -> None:
        self._host, self._cond = host, cond
        self._stage: Stage | None = None

    def _store(self) -> tuple[Plan, ParameterStore]:
        host = self._host
        if host.plan is None or host.store is None:
            raise NotInitializedError(f"Shard {host.shard_index} has no optimizer before Init.")
        return host.plan, host.store

    def layout(self) -> Layout:
        """The state each owned partition takes (read it outside the lock with :class:`StateIntake`).

        Raises:
            NotInitializedError: before Init.
        """
        with self._cond:
            plan, store = self._store()
            return Layout(plan, self._host.shard_index, store)

    def read(self) -> tuple[int, list[StateValue]]:
        """(version, copies of every trained partition's state values, plan order). A streamed
        round's speculatively stepped slots are put back first (as a checkpoint does), so the
        state read is the version's.

        Raises:
            NotInitializedError: before Init.
        """
        with self._cond:
            _, store = self._store()
            self._host.streams.end("the optimizer state was read mid-round")
            out = []
            for i in store.trained_index:
                part = store.partitions[i]
                for name, v in store.optimizer.state.get(store.tensors[i], {}).items():
                    if isinstance(v, torch.Tensor):
                        out.append(StateValue(part.key, part.offset, name, v.detach().clone()))
            return self._host.version, out

    def stage(self, layout: Layout, state: dict[int, dict[str, torch.Tensor]]) -> int:
        """Keep ``state`` (:meth:`StateIntake.finish`) until :meth:`commit`; returns its stage id.

        Raises:
            PreconditionError: the shard was initialized or restored again since ``layout`` was read.
        """
        with self._cond:
            _, store = self._store()
            if store is not layout.store:
                raise PreconditionError(
                    "The shard's parameters were replaced while the optimizer state arrived; push again."
                )
            self._stage = Stage(secrets.randbits(63) + 1, store, state)
            return self._stage.stage

    def commit(self, stage: int) -> int:
        """Put the staged state in force: every trained partition's state becomes the stage's (none
        where it gives none), after a streamed round's stepped slots are put back (its round is
        then applied whole, with this state). Returns the version.

        Raises:
            PreconditionError: no stage of that id (another push replaced it, or the shard restarted
                or was initialized again since): push the state again.
        """
        with self._cond:
            _, store = self._store()
            staged = self._stage
            if staged is None or staged.stage != stage or staged.store is not store:
                raise PreconditionError(
                    f"Shard {self._host.shard_index} holds no staged optimizer state {stage} (replaced by a later "
                    "push, or the shard restarted); push the state again, then commit it."
                )
            self._host.streams.end("the optimizer state was replaced mid-round")
            store.replace_state(staged.state)
            self._stage = None
            return self._host.version
