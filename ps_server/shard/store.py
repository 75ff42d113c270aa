"""Parameter store of one shard: its partitions as flat tensors and a torch.optim optimizer over them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ps_common import tracing
from ps_common.codec import torch_dtype
from ps_common.errors import NonFiniteUpdateError, UpdateRefusedError
from ps_common.optimizer import OptimizerSpec, check_hyperparameter_range
from ps_common.optimizer_args import set_group_value
from ps_common.plan import PartitionSlice, Plan
from ps_server.core.finite import all_finite
from ps_server.core.partitions import max_abs_of


class ParameterStore:
    """Owned partitions of one shard, each a 1-D leaf tensor, stepped by one optimizer.

    Args:
        plan: the cluster's plan.
        shard_index: which shard this is.
        values: initial values, one 1-D tensor per owned partition in plan order (copied).
        optimizer: the validated optimizer spec.

    Raises:
        InvalidRequestError: an optimizer argument beyond the range of the parameters' dtypes.
    """

    def __init__(self, plan: Plan, shard_index: int, values: Sequence[torch.Tensor], optimizer: OptimizerSpec) -> None:
        self.plan = plan
        self.partitions: tuple[PartitionSlice, ...] = plan.owned_by(shard_index)
        dtypes = {s.key: torch_dtype(s.dtype) for s in plan.specs}
        self.tensors = [
            v.detach().to(dtypes[p.key]).clone().requires_grad_(False)
            for p, v in zip(self.partitions, values, strict=True)
        ]
        optimizer.check_range(dtypes.values())
        self.optimizer_spec = optimizer
        # A shard may own no partition (a model smaller than one partition per shard); torch.optim
        # refuses an empty parameter list, so the spec is then checked on a stand-in tensor.
        buffers = set(optimizer.buffers)
        self.buffer_index = [i for i, p in enumerate(self.partitions) if p.key in buffers]
        self.trained_index = [i for i, p in enumerate(self.partitions) if p.key not in buffers]
        self.trained = [self.tensors[i] for i in self.trained_index]  # what the optimizer steps
        self.optimizer = (
            optimizer.build(self.trained, optimizer.group_of(self.partitions[i].key for i in self.trained_index))
            if self.trained
            else optimizer.build([torch.zeros(1)])
        )
        self._dtypes = list(dtypes.values())
        self._limit: float | None = None  # a quarter of the largest value of the trained dtypes (_sgd_stays_finite)
        # per group, the hyperparameters pushes last set (see set_hyperparameters)
        self._pushed: list[dict[str, float]] = [{} for _ in self.optimizer.param_groups]
        self._backup: dict[tuple[int, str], torch.Tensor] = {}
        # SGD: upper bounds of |parameter| and |momentum buffer| (see _sgd_stays_finite); None: measure
        self._bounds: tuple[float, float] | None = None
        # streamed rounds (step_slot): slot -> what its undo restores besides the values; and the
        # hyperparameters before the round's were set
        self._stepped: dict[int, dict[str, Any] | None] = {}
        self._stepped_hyper: list[dict[str, Any]] | None = None

    @property
    def num_elements(self) -> int:
        return sum(t.numel() for t in self.tensors)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def check_hyperparameters(self, groups: Sequence[Mapping[str, float]]) -> None:
        """Refuse per-step hyperparameters (one mapping per parameter group) the optimizer cannot
        take, or out of the parameters' dtype range, before anything is held or applied.

        Raises:
            InvalidRequestError: see :meth:`OptimizerSpec.check_hyperparameters`.
        """
        self.optimizer_spec.check_hyperparameters(groups, len(self.optimizer.param_groups))
        for values in groups:
            check_hyperparameter_range(values, self._dtypes)

    def set_hyperparameters(self, groups: Sequence[Mapping[str, float]]) -> list[dict[str, Any]]:
        """Set each parameter group's values (checked by :meth:`check_hyperparameters`); they stay
        in force. The latest change wins: a value equal to the one pushed before leaves the group
        as it is (an operator's UpdateConfig lr holds until a worker's schedule changes the lr).
        Returns the previous values, for :meth:`restore_hyperparameters`."""
        old = []
        for g, (group, values) in enumerate(zip(self.optimizer.param_groups, groups, strict=True)):
            old.append({k: v for k, v in group.items() if k != "params"})
            old[-1]["__pushed__"] = dict(self._pushed[g])
            for k, v in values.items():
                if self._pushed[g].get(k) == v:
                    continue
                self._pushed[g][k] = v
                set_group_value(group, k, v)
        return old

    def restore_hyperparameters(self, old: Sequence[Mapping[str, Any]]) -> None:
        for g, (group, values) in enumerate(zip(self.optimizer.param_groups, old, strict=True)):
            values = dict(values)
            self._pushed[g] = values.pop("__pushed__")
            group.update(values)

    def replace_state(self, state: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """Replace the optimizer state of every trained partition with ``state`` (partition index,
        plan order among the shard's -> torch's name -> tensor, copied; a partition absent gets
        none, as before its first step), checked by :mod:`ps_server.shard.optimizer_state`."""
        for i in self.trained_index:
            entry = state.get(i)
            if entry:
                self.optimizer.state[self.tensors[i]] = {k: v.clone() for k, v in entry.items()}
            else:
                self.optimizer.state.pop(self.tensors[i], None)
        self._bounds = None  # measured again at the next step that needs them

    def assign_buffers(self, values: Sequence[torch.Tensor]) -> None:
        """Set the buffer partitions to ``values`` (one tensor per owned partition, plan order; the
        others are ignored; None leaves that buffer). Cannot fail: the values were checked as they arrived."""
        for i in self.buffer_index:
            if values[i] is not None:
                self.tensors[i].copy_(values[i])

    def apply(
        self,
        grads: Sequence[torch.Tensor],
        lr_scale: float = 1.0,
        hyper: Sequence[Mapping[str, float]] = (),
        buffers: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """One optimizer step with ``grads`` (one 1-D tensor per partition, plan order; None leaves a
        partition and its optimizer state alone, as torch.optim does a parameter without grad), all or
        nothing: a step that raises, or that leaves a parameter or an optimizer state value
        non-finite (inf, NaN), is undone and refused.

        Args:
            grads: gradients; cast to each partition's dtype. A
                :class:`~ps_server.core.partitions.Bounded` gives the bound of their magnitudes
                that the SGD finiteness proof needs (else it reads them once for it).
            lr_scale: multiplies every group's learning rate for this step only.
            hyper: per parameter group, hyperparameters set for this step and kept after it
                (checked by :meth:`check_hyperparameters`); () keeps the groups' own. A refused
                step leaves the previous ones.
            buffers: one tensor per partition; after a successful step the buffer partitions
                take these values (the others are ignored). None: buffers stay.

        Raises:
            NonFiniteUpdateError: the step would have made parameters or optimizer state non-finite.
            UpdateRefusedError: the optimizer step raised. Either way the parameters, the
                optimizer state and the hyperparameters are exactly as before.
        """
        old = self.set_hyperparameters(hyper) if hyper else None
        try:
            trained = [grads[i] for i in self.trained_index] if self.buffer_index else grads
            with tracing.span("optimizer_step", optimizer=self.optimizer_spec.name, partitions=len(grads)):
                self._apply(trained, lr_scale, max_abs_of(grads))
        except Exception:
            if old is not None:
                self.restore_hyperparameters(old)
            raise
        if buffers is not None:
            self.assign_buffers(buffers)

    def _apply(self, grads: Sequence[torch.Tensor], lr_scale: float, known: float = math.inf) -> None:
        if not self.trained or all(g is None for g in grads):  # nothing to step (a fragment owned elsewhere)
            return
        whole = all(g is not None for g in grads)  # None: a partition left alone (a diloco fragment round)
        bounds = self._sgd_stays_finite(grads, lr_scale, known) if whole and self._plain_sgd() else None
        saved = self._save() if bounds is None else []
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        try:
            for t, g in zip(self.trained, grads, strict=True):
                t.grad = None if g is None else g.to(t.dtype)
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * lr_scale
            self.optimizer.step()  # the tensors need no grad: the step records no graph
        except Exception as exc:  # torch raises RuntimeError, ValueError, OverflowError...
            if bounds is not None:  # a step proven finite failed otherwise: state unknown, measure again
                self._bounds = None
                raise
            self._restore(saved)
            raise UpdateRefusedError(f"The optimizer step failed ({exc}); nothing was applied.") from exc
        finally:
            for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
            for t in self.trained:
                t.grad = None
        if bounds is not None:
            self._bounds = bounds
            return
        if not (all_finite(self.trained) and all_finite(self._state_tensors())):
            self._restore(saved)
            raise NonFiniteUpdateError(
                "The update would make parameters or optimizer state non-finite (inf or NaN); it was refused and "
                "they are unchanged."
            )
        self._bounds = None  # measured again at the next step that needs them

    # ------------------------------------------------------------------ streamed rounds
    def step_slot(
        self,
        index: int,
        grad: torch.Tensor,
        hyper: Sequence[Mapping[str, float]] = (),
        buffer: torch.Tensor | None = None,
    ) -> None:
        """Step partition ``index`` alone, ahead of its round's close (a streamed sync round,
        :mod:`ps_server.shard.round_stream`): its values and optimizer state are copied first, so that
        :meth:`undo_slots` can put every slot stepped since the last :meth:`commit_slots` back
        exactly. The result is bitwise the one :meth:`apply` gives that partition: torch.optim's
        single-tensor step on CPU treats every parameter on its own (every optimizer of
        :data:`~ps_common.optimizer_args.TORCH_CLASSES`), and a parameter whose ``grad`` is None
        is left alone.

        Args:
            index: the partition's position among the shard's (plan order).
            grad: 1-D, the partition's length; the round's rank-ordered mean (any float dtype).
            hyper: the round's hyperparameters (set with the first slot, kept by
                :meth:`commit_slots`, restored by :meth:`undo_slots`).
            buffer: for a buffer partition, the value it takes (the round's lowest rank's).

        Raises:
            NonFiniteUpdateError: the step would leave the partition's values or state non-finite
                (the slot is put back; the other stepped slots stay until :meth:`undo_slots`).
            UpdateRefusedError: the optimizer step raised (the slot is put back).
        """
        if not self._stepped and hyper:
            self._stepped_hyper = self.set_hyperparameters(hyper)
        t = self.tensors[index]
        entry = self._save_slot(index)
        self._stepped[index] = entry
        if index in self.buffer_index:
            t.copy_(grad if buffer is None else buffer)
            return
        try:
            t.grad = grad.to(t.dtype)
            with torch.no_grad():
                self.optimizer.step()
        except Exception as exc:  # torch raises RuntimeError, ValueError, OverflowError...
            self._restore_slot(index, self._stepped.pop(index))
            raise UpdateRefusedError(f"The optimizer step failed ({exc}); nothing was applied.") from exc
        finally:
            t.grad = None
        state = [v for v in self.optimizer.state.get(t, {}).values() if isinstance(v, torch.Tensor)]
        if not (all_finite([t]) and all_finite(state)):
            self._restore_slot(index, self._stepped.pop(index))
            raise NonFiniteUpdateError(
                "The update would make parameters or optimizer state non-finite (inf or NaN); it was refused and "
                "they are unchanged."
            )

    @property
    def stepped_slots(self) -> frozenset[int]:
        """The partitions stepped by :meth:`step_slot` since the last commit or undo."""
        return frozenset(self._stepped)

    def commit_slots(self) -> None:
        """The stepped slots are the round's step: keep them (and the hyperparameters set)."""
        self._stepped.clear()
        self._stepped_hyper = None
        self._bounds = None  # measured again at the next step that needs them

    def undo_slots(self) -> None:
        """Put every slot stepped since the last commit back as it was, hyperparameters too."""
        for index, entry in self._stepped.items():
            self._restore_slot(index, entry)
        self._stepped.clear()
        if self._stepped_hyper is not None:
            self.restore_hyperparameters(self._stepped_hyper)
            self._stepped_hyper = None

    def _save_slot(self, index: int) -> dict[str, Any] | None:
        t = self.tensors[index]
        self._copy((-1 - index, ""), t)
        state = self.optimizer.state.get(t)
        if not state:
            return None
        return {k: self._copy((-1 - index, k), v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def _restore_slot(self, index: int, entry: dict[str, Any] | None) -> None:
        t = self.tensors[index]
        t.copy_(self._backup[(-1 - index, "")])
        if index not in self.buffer_index:
            self._restore_state(t, entry)

    def _plain_sgd(self) -> bool:
        """True for torch.optim.SGD's single-tensor path (one group, not maximizing)."""
        groups = self.optimizer.param_groups
        if len(groups) != 1 or not isinstance(self.optimizer, torch.optim.SGD):
            return False
        g = groups[0]
        return not (g.get("maximize") or g.get("foreach") or g.get("fused") or g.get("differentiable"))

    def _sgd_stays_finite(
        self, grads: Sequence[torch.Tensor], lr_scale: float, known: float = math.inf
    ) -> tuple[float, float] | None:
        """Bounds proving an SGD step keeps every value finite, or None when they do not.

        SGD has no division or square root, so from finite values it can only overflow. With
        G >= max |g| (the largest L2 norm: one read of the gradients), and P, B upper bounds of |param| and |momentum
        buffer| carried from step to step, every value the step computes is bounded by
        ``|g + wd p| <= G + wd P``, ``|buf'| <= m B + |1 - dampening| (G + wd P)`` and
        ``|p'| <= P + lr |update|``; when all stay below a quarter of the dtype's largest value
        (room for rounding), the step cannot produce inf or NaN, and needs no copy and no check.

        Args:
            known: a bound of the gradients' magnitudes found when they arrived (the L2 norms of
                their finiteness check); ``inf``: read them here.

        Returns:
            (P', B') for the step's result, or None: a non-finite gradient, or bounds too close
            to the dtype's range (the step is then copied and checked).
        """
        limit = self._limit
        if limit is None:
            limit = self._limit = min(torch.finfo(t.dtype).max for t in self.trained) / 4
        g_max = known if math.isfinite(known) else _max_abs(grads)
        if self._bounds is None:
            self._bounds = (_max_abs(self.trained), _max_abs(self._state_tensors()))
        p_max, b_max = self._bounds
        group = self.optimizer.param_groups[0]
        lr, wd, momentum = group["lr"] * lr_scale, group["weight_decay"], group["momentum"]
        grad = g_max + wd * p_max
        buf = 0.0
        if momentum != 0:
            state = self.optimizer.state
            started = True
            for t in self.trained:
                started = started and "momentum_buffer" in state.get(t, ())
            buf = momentum * b_max + abs(1 - group["dampening"]) * grad if started else grad
            update = grad + momentum * buf if group["nesterov"] else buf
        else:
            update = grad
        new_p = p_max + lr * update
        scalars = (lr, wd, momentum, abs(1 - group["dampening"]))  # torch converts them to the dtype
        values = (*scalars, g_max, grad, momentum * b_max, buf, update, lr * update, new_p)
        bounded = math.isfinite(sum(values)) and min(values) >= 0 and max(values) < limit  # no inf, no NaN
        return (new_p, buf) if bounded else None

    def _state_tensors(self) -> Iterable[torch.Tensor]:
        for t in self.trained:
            for v in self.optimizer.state.get(t, {}).values():
                if isinstance(v, torch.Tensor):
                    yield v

    def _save(self) -> list[dict[str, Any] | None]:
        """Copy the parameters and optimizer state into buffers kept from step to step (no
        allocation on the hot path); returns what :meth:`_restore` needs besides them."""
        saved: list[dict[str, Any] | None] = []
        for i, t in enumerate(self.trained):
            self._copy((i, ""), t)
            state = self.optimizer.state.get(t)
            saved.append(
                None
                if not state
                else {k: self._copy((i, k), v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            )
        return saved

    def _copy(self, key: tuple[int, str], t: torch.Tensor) -> torch.Tensor:
        buf = self._backup.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._backup[key] = torch.empty_like(t)
        return buf.copy_(t)

    def _restore(self, saved: list[dict[str, Any] | None]) -> None:
        """Put back what :meth:`_save` copied: parameters, and optimizer state (state a first step
        created is removed again)."""
        for i, t in enumerate(self.trained):
            t.copy_(self._backup[(i, "")])
            self._restore_state(t, saved[i])

    def _restore_state(self, t: torch.Tensor, entry: dict[str, Any] | None) -> None:
        """Put back ``t``'s optimizer state as ``entry`` (copies made by :meth:`_copy`) holds it;
        None: the step created it, so it goes."""
        if entry is None:
            self.optimizer.state.pop(t, None)
            return
        state = self.optimizer.state[t]
        for k in [k for k in state if k not in entry]:
            del state[k]
        for k, v in entry.items():
            current = state.get(k)
            if isinstance(v, torch.Tensor) and isinstance(current, torch.Tensor) and current.shape == v.shape:
                current.copy_(v)
            else:
                state[k] = v.clone() if isinstance(v, torch.Tensor) else v


def _max_abs(tensors: Iterable[torch.Tensor]) -> float:
    """An upper bound of the absolute values in ``tensors``: the largest L2 norm (one BLAS dot per
    float32/float64 tensor, the cheapest read there is), else the largest absolute value. 0 when
    empty; inf or NaN when a tensor holds inf or NaN, or its squares overflow."""
    out = 0.0
    for t in tensors:
        if not t.is_floating_point() or not t.numel():
            continue
        if t.dtype in (torch.float32, torch.float64) and t.dim() == 1:
            bound = math.sqrt(float(torch.dot(t, t)))
        else:
            low, high = torch.aminmax(t)
            bound = max(-float(low), float(high))
        if not math.isfinite(bound) or math.isnan(bound):
            return math.inf
        out = max(out, bound)
    return out
