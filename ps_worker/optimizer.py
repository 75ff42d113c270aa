"""``DistributedOptimizer``: a torch optimizer whose ``step()`` runs on the shards, in every consistency model."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ps_common.codec import torch_dtype
from ps_worker import optim_wrap, optimizer_state, torch_state
from ps_worker.client import PSClient
from ps_worker.clipping import RoundClipper, amp_skip, check_clip_args
from ps_worker.local_sgd import LocalSteps
from ps_worker.tables.modules import push_step
from ps_worker.transport.pushpull import PendingPushPull

log = logging.getLogger(__name__)


class DistributedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose step runs on the shards.

    - sync, async, ssp: ``step()`` pushes every parameter's ``.grad`` (the shards run the
      optimizer) and pulls the updated weights, in one PushPull call per shard. Sync pulls wait
      for the round (BSP); ssp pulls wait while this rank is more than s clocks ahead of the
      slowest; async pulls never wait. A push the shards refuse as too stale (ABORTED) is counted
      in ``client.refused_pushes``, the weights are pulled, and training carries on.
    - easgd: ``step()`` runs ``local_optimizer``; every tau-th step it exchanges with the center
      (Zhang, Choromanska, LeCun 2015, Algorithm 1). diloco: ``step()`` is an inner step of
      ``local_optimizer``; every H-th step pushes the outer gradient and pulls the outer optimizer's
      result (Douillard et al. 2023, Algorithm 1; :mod:`ps_worker.local_sgd`).

    As a torch optimizer: ``param_groups`` mirror the server optimizer's groups (the Init spec's
    ``groups`` after group 0 of the parameters in none) with its numeric hyperparameters (``lr``,
    ``momentum``, ``weight_decay``...); every push carries each group's current values, so an
    ``torch.optim.lr_scheduler`` stepping this optimizer drives the shards: sync applies a round
    with the values its ranks sent (they must agree, or the round is refused with
    FAILED_PRECONDITION), async and ssp apply each push with its own. The values stay in force
    on the shards after the step; the latest change wins (an operator's ``ps-admin set --lr``
    holds until this optimizer's lr changes, e.g. at the scheduler's next change). ``state_dict()`` and
    ``load_state_dict()``, ``zero_grad(set_to_none=...)`` and ``step(closure)`` work as for any
    torch optimizer.

    AMP: ``torch.amp.GradScaler`` calls ``step()`` on every step (``_step_supports_amp_scaling``);
    scaled gradients are unscaled here; a step whose gradients overflowed pushes a skip, and in
    sync mode any rank's skip skips the round's step on every shard (as the all-reduced gradients
    of DDP would make every rank skip); the round still closes, so nothing hangs. Pass
    ``grad_scaler`` so a rank whose own gradients were finite backs its scale off too.

    Parameters without a gradient push zeros.

    Clipping: :meth:`clip_grad_norm_` (FSDP's name), called where a DDP script calls
    ``torch.nn.utils.clip_grad_norm_`` (after backward, before ``step()``), clips the round's
    averaged gradient by its global norm over every shard, as DDP's clip does (sync only).
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on a worker clips that rank's own
    gradient before it is averaged, which is not what DDP does. Embedding tables' rows: pushed
    before the dense step, or beside it with a ``ps_worker.tables.RowPrefetcher``.

    Args:
        model: the module whose parameters the client was initialized with.
        client: an initialized :class:`PSClient`.
        optimizer: the script's torch optimizer (or list, e.g. AdamW + SparseAdam for the tables),
            as given to ``client.init`` (Horovod's pattern): ``param_groups`` are its own group
            dicts, so an lr scheduler on it or on this object sets what every push (and PushRows,
            for the tables' group) carries; in easgd it is the local optimizer. None: groups
            mirror the shards' optimizer spec.
        local_optimizer: easgd's (diloco's inner) optimizer when ``optimizer`` is not given;
            ignored in other modes.
        overlap: push each parameter's gradient while backward still runs (sync, async, ssp):
            autograd hooks (``register_post_accumulate_grad_hook``) hand every finished gradient to
            a :class:`~ps_worker.transport.pushpull.PendingPushPull`, whose streams send each message as soon
            as its partitions are ready; ``step()`` then only finishes the call. With
            ``backward_passes_per_step=k`` a gradient is handed over after its k-th backward pass.
            Not with AMP (the gradients would leave scaled): refused at ``step()``.
        backward_passes_per_step: k backward passes accumulate into ``.grad`` before each
            ``step()`` (Horovod's name): the push carries their sum, as torch accumulates it
            (divide the loss by k for the mean, as with DDP). With ``overlap`` or k > 1, a
            ``step()`` after another number of backward passes is refused (ValueError).
        grad_scaler: the ``torch.amp.GradScaler`` stepping this optimizer, if any: a round
            skipped because of another rank's overflow then counts as an overflow for this
            rank's scaler too, so every rank's scale stays the same (DDP's behaviour).
        broadcast_buffers: DDP's default: every step pushes this rank's buffers (BatchNorm
            running statistics) with its gradients, the shards keep rank 0's, and every rank
            loads them before its next forward, so at each forward every rank starts from rank
            0's buffers (as DDP's broadcast at the start of forward; with accumulation, as DDP
            with ``no_sync()`` on all but the last micro-batch). Needs ``client.init(model, ...,
            buffers=True)`` (the default). False: the buffers stay each rank's own (still pushed,
            since they are in the plan).

    Raises:
        ValueError: easgd or diloco without a local optimizer; ``optimizer`` not what the shards run
            (``ps_worker.optim_wrap.bind``); backward_passes_per_step < 1; overlap with a
            grad_scaler; broadcast_buffers with buffers the client's plan does not carry.
    """

    _step_supports_amp_scaling = True  # GradScaler calls step() every step, grad_scale and found_inf set

    def __init__(
        self,
        model: torch.nn.Module,
        client: PSClient,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        *,
        local_optimizer: torch.optim.Optimizer | None = None,
        overlap: bool = False,
        backward_passes_per_step: int = 1,
        grad_scaler: Any | None = None,
        broadcast_buffers: bool = True,
    ) -> None:
        local = client.worker_mode.local_optimizer
        if local and local_optimizer is None and optimizer is not None:
            local_optimizer = optim_wrap.single(optimizer)  # easgd, diloco: the wrapped optimizer steps locally
        if local and local_optimizer is None:
            raise ValueError(
                f"This cluster runs {client.mode}: pass the optimizer that steps locally, "
                "DistributedOptimizer(model, client, torch.optim.AdamW(...)) or local_optimizer=..."
            )
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}.")
        if overlap and grad_scaler is not None:
            raise ValueError(
                "overlap=True pushes gradients during backward, before a GradScaler unscales them or sees an "
                "overflow; use overlap=False with AMP."
            )
        self.model, self.client = model, client
        self.local_optimizer = local_optimizer
        self.params = dict(model.named_parameters())
        self.overlap, self.backward_passes_per_step = overlap, backward_passes_per_step
        self.grad_scaler = grad_scaler
        self._pending: PendingPushPull | None = None
        self._clipper = RoundClipper(client)  # clip_grad_norm_ (ps_worker.clipping)
        self._passes: dict[str, int] = {}
        plan = client.path.plan
        self.broadcast_buffers = broadcast_buffers
        self.buffers = {k: b for k, b in model.named_buffers() if k in plan.dtypes}
        missing = [k for k, b in model.named_buffers() if b is not None and k not in plan.dtypes]
        if broadcast_buffers and missing:
            raise ValueError(
                f"broadcast_buffers needs the buffers in the plan, but {missing[:4]} are not: call "
                "client.init(model, ..., buffers=True), or pass broadcast_buffers=False."
            )
        # pulled rank-0 buffer values, loaded into the model before its next forward
        self._buffers_in = {k: torch.empty(b.shape, dtype=torch_dtype(plan.dtypes[k])) for k, b in self.buffers.items()}
        self._buffers_due = False
        if self.buffers:
            model.register_forward_pre_hook(self._load_buffers)
        spec = client.optimizer_spec
        self._names = sorted(spec.hyperparameter_names) if spec is not None else ["lr"]
        base = dict(spec.kwargs) if spec is not None else {"lr": float(client.config.learning_rate)}
        defaults = {k: float(v) for k, v in base.items() if k in self._names}
        overrides = [{}, *(kwargs for _, kwargs in spec.groups)] if spec is not None else [{}]
        index = spec.group_of(self.params) if spec is not None else [0] * len(self.params)
        members: list[list[torch.Tensor]] = [[] for _ in overrides]
        for g, p in zip(index, self.params.values(), strict=True):
            members[g].append(p)
        param_groups = [
            {"params": ps, **{k: float(v) for k, v in kw.items() if k in self._names}}
            for ps, kw in zip(members, overrides, strict=True)
        ]
        wrapped = optimizer if optimizer is not None else (local_optimizer if local else None)
        named = list(self.params.items())
        self._translation = None if wrapped is None or local else optim_wrap.bind(client, named, wrapped)
        if wrapped is not None:  # the user's own group dicts: a scheduler on either optimizer moves both
            param_groups, defaults = optim_wrap.shared_groups(wrapped)
        super().__init__(param_groups, {} if wrapped is not None else defaults)
        self.defaults = defaults
        torch_state.adopt(self, wrapped)  # torch state loaded before (or after) this: to the shards
        if wrapped is not None:
            self.register_step_post_hook(lambda *_: optim_wrap.mark_stepped(wrapped))
        args = (self.buffers, self._buffer_values, self._out, self._buffers_pulled)  # easgd, diloco's steps
        self.local = LocalSteps(client, self.params, local_optimizer, *args) if local_optimizer and local else None
        for key, p in self.params.items():  # the hooks stay; they count passes and, with overlap, push
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, key))

    # ------------------------------------------------------------------ torch.optim.Optimizer
    def hyperparameters(self) -> list[dict[str, float]]:
        """Per parameter group of the shards' optimizer, the values a push carries (its numeric
        arguments; with a wrapped torch optimizer, read from its groups: ``ps_worker.torch_optim``)."""
        if self._translation is not None:
            return self._translation.hyperparameters(self._names)
        return [{k: float(g[k]) for k in self._names if k in g} for g in self.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict: ``state`` is the server optimizer's (moments, steps...)
        gathered from the shards in torch's layout (:mod:`ps_worker.optimizer_state`; empty in easgd
        and diloco, whose outer state stays in the shards' checkpoints), ``param_groups`` with their
        lr...; ``ps``: the local optimizer's state and steps (``LocalSteps.state_dict``). Raises:
            ShardError: a shard refused the read."""
        out = super().state_dict()
        out["state"] = optimizer_state.state_of(self)
        out["ps"] = self.local.state_dict() if self.local is not None else {"local_steps": 0, "local_optimizer": None}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output, or a torch optimizer's of the same class, model and
        groups (a DDP or single-process run): its ``state`` goes to the shards, all or nothing (rank 0
        sends it; :func:`ps_worker.optimizer_state.load`), its groups' values into the group dicts in use.

        Raises:
            ValueError: the state_dict does not fit this optimizer's groups or the model's shapes.
            ShardError: INVALID_ARGUMENT, a shard refused the state (e.g. another optimizer
                class's); nothing was loaded.
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop("ps", None) or {}
        super().load_state_dict(optimizer_state.load(self, state_dict))
        if self.local is not None:
            self.local.load_state_dict(extra)

    # ------------------------------------------------------------------ buffers
    def _load_buffers(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: load the buffers of rank 0 the last step pulled (DDP's broadcast)."""
        if self._buffers_due and self.broadcast_buffers:
            with torch.no_grad():
                for k, b in self.buffers.items():
                    b.copy_(self._buffers_in[k])
        self._buffers_due = False

    def _buffers_pulled(self) -> None:
        self._buffers_due = True  # loaded before the next forward

    def _out(self) -> dict[str, torch.Tensor]:
        """Where a pull writes: the parameters themselves, and the buffers' staging tensors."""
        return {**{k: p.data for k, p in self.params.items()}, **self._buffers_in}

    def _buffer_values(self) -> dict[str, torch.Tensor]:
        """This rank's buffers as the plan carries them (integers as float64)."""
        return {k: b.detach().to(self._buffers_in[k].dtype) for k, b in self.buffers.items()}

    # ------------------------------------------------------------------ gradients
    def _grad_ready(self, key: str, param: torch.Tensor) -> None:
        """Autograd hook: ``param``'s gradient is final for this backward pass."""
        passes = self._passes[key] = self._passes.get(key, 0) + 1
        if param.grad is None or not self.overlap or self.client.worker_mode.local_optimizer:
            return
        if passes != self.backward_passes_per_step:
            return
        if self._pending is None:
            self._pending = self.client.begin_push_pull(self._out(), hyperparameters=self.hyperparameters())
        self._pending.ready(key, param.grad)

    def _check_passes(self) -> None:
        """Refuse a step after another number of backward passes than ``backward_passes_per_step``
        (with overlap, or k > 1; a single-pass step without overlap accepts any count, as before)."""
        passes, self._passes = self._passes, {}
        k = self.backward_passes_per_step
        if not (self.overlap or k > 1):
            return
        wrong = {key: n for key, n in passes.items() if n != k}
        if wrong:
            if self._pending is not None:
                self._pending.cancel()
                self._pending = None
            key, n = next(iter(wrong.items()))
            raise ValueError(
                f"step() after {n} backward passes of {key!r}, but backward_passes_per_step={k}: call backward "
                f"exactly {k} times per step (or create the optimizer with backward_passes_per_step={n}); "
                "nothing was pushed."
            )

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip this step's averaged gradient by its L2 norm over every shard, as DDP followed by
        ``torch.nn.utils.clip_grad_norm_`` does: ``g_avg *= min(1, max_norm / (||g_avg|| + 1e-6))``
        (sync mode; every rank must call it, with the same ``max_norm``, after backward and before
        ``step()``). It pushes the gradients (each shard holds the round and answers its part of
        the squared norm); ``step()`` then sends the coefficient and pulls the clipped round's
        weights: one more small round trip per step than an unclipped one (``ps_worker.clipping``).
        With AMP, call ``scaler.unscale_(optimizer)`` first and pass ``grad_scaler=``. Buffers and
        embedding tables are not in the norm.

        Args:
            max_norm: the largest norm allowed, > 0. norm_type: 2.0 only.

        Returns:
            The total norm of the averaged gradient (0-dim float32 tensor), the same on every rank;
            ``inf`` when the round is skipped for an AMP overflow.

        Raises:
            ValueError: ``max_norm`` not a finite number > 0, ``norm_type`` not 2, the number of
                backward passes differs from ``backward_passes_per_step``, or ``overlap=True``:
                nothing pushed.
            RuntimeError: not sync mode; a GradScaler that did not unscale first; called twice
                before ``step()``. grpc.RpcError: as :meth:`step`.
        """
        max_norm = check_clip_args(max_norm, norm_type)
        self._clipper.check_mode()
        if self.overlap:
            raise ValueError("clip_grad_norm_ needs overlap=False: the whole gradient is known before it is pushed.")
        amp = self.grad_scaler is not None and self.grad_scaler.is_enabled()
        skip = amp_skip(self.grad_scaler._per_optimizer_states.get(id(self), {}) if amp else None)
        self._check_passes()
        grads = {k: p.grad if p.grad is not None and not skip else torch.zeros_like(p) for k, p in self.params.items()}
        grads.update(self._buffer_values())
        return self._clipper.push(grads, self.hyperparameters(), skip, max_norm)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One training step.

        Args:
            closure: re-evaluates the model and returns the loss (run with gradients enabled
                before the step), as for any torch optimizer.

        Returns:
            The closure's loss when one is given; otherwise the version the model now holds
            (sync: the round number after this step).

        Raises:
            ValueError: the number of backward passes does not match ``backward_passes_per_step``.
            RuntimeError: AMP (a GradScaler) with ``overlap``.
            grpc.RpcError: see :meth:`PSClient.push_pull` and :meth:`PSClient.exchange`; a sync
                round whose ranks sent different hyperparameters: FAILED_PRECONDITION.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        version = self._step()
        return loss if closure is not None else version

    def _step(self) -> int:
        found_inf = getattr(self, "found_inf", None)
        grad_scale = getattr(self, "grad_scale", None)
        amp = found_inf is not None
        if amp and self._pending is not None:
            self._pending.cancel()
            self._pending = None
            self._passes = {}
            raise RuntimeError(
                "DistributedOptimizer(overlap=True) pushes gradients during backward, before GradScaler unscales "
                "them or sees an overflow; use overlap=False with AMP. Nothing was pushed."
            )
        self._check_passes()
        skip = amp and float(found_inf) > 0
        if self._clipper.due and grad_scale is not None:
            raise RuntimeError(
                "clip_grad_norm_ pushed gradients a GradScaler had not unscaled: pass grad_scaler= to "
                "DistributedOptimizer and call scaler.unscale_(optimizer) before clip_grad_norm_."
            )
        if grad_scale is not None and not skip:
            inv = grad_scale.double().reciprocal().float()
            for p in self.params.values():
                if p.grad is not None:
                    p.grad.mul_(inv.to(p.grad.device))
        tables = self.client.tables  # row gradients before the dense step, or beside it (ps_worker.tables.prefetch)
        pushed = push_step(tables, inv if grad_scale is not None and not skip else None, skip) if tables else None
        version = self.local.step(skip) if self.local is not None else self._push_pull_step(skip)
        if pushed is not None:
            pushed()  # the row push's errors are the step's
        return version

    def count_samples(self, n: int) -> None:
        """diloco: add ``n`` (the batch's size) to this rank's samples of the outer round, its FedAvg
        weight (every rank counts, or none: a plain mean; once called, each outer round sends its
        count, and 0 weighs nothing). Raises:
            ValueError: not an integer >= 0. RuntimeError: not a local-optimizer mode."""
        if self.local is None:
            raise RuntimeError(f"count_samples weights diloco's outer rounds; this cluster runs {self.client.mode}.")
        self.local.count_samples(n)

    def _push_pull_step(self, skip: bool) -> int:
        """The step of sync, async and ssp (easgd's and diloco's: :meth:`LocalSteps.step
        <ps_worker.local_sgd.LocalSteps.step>`): push every gradient (and
        this rank's buffers) and pull the weights in one PushPull per shard, or finish the one that
        began during backward (``overlap``). ``skip``: AMP found inf, push a skip (zeros).

        Returns:
            The version the model now holds (sync: the round number after this step).
        """
        if self._clipper.due:  # clip_grad_norm_ pushed this step: send the coefficient, pull
            version = self._clipper.finish(self._out())
            self._buffers_due = True
            if self.client.last_step_skipped and not skip:
                self._overflow_elsewhere()
            return version
        if self._pending is not None:  # overlap: the pushes began during backward
            pending, self._pending = self._pending, None
            for k, v in self._buffer_values().items():
                pending.ready(k, v)
            version = pending.finish()
            self._buffers_due = True
            return version
        grads = {
            k: (p.grad if p.grad is not None and not skip else torch.zeros_like(p)) for k, p in self.params.items()
        }
        grads.update(self._buffer_values())
        version = self.client.push_pull(grads, self._out(), self.hyperparameters(), skip)
        self._buffers_due = True
        if self.client.last_step_skipped and not skip:
            self._overflow_elsewhere()
        return version

    def _overflow_elsewhere(self) -> None:
        """The round was skipped for another rank's overflow: tell this rank's GradScaler, so its
        ``update()`` backs off as every rank's does under DDP."""
        if self.grad_scaler is None:
            log.info(
                "rank %d: the round was skipped for another rank's overflow; pass grad_scaler= to "
                "DistributedOptimizer to keep every rank's loss scale the same",
                self.client.rank,
            )
            return
        state = self.grad_scaler._per_optimizer_states.get(id(self))
        for found in (state or {}).get("found_inf_per_device", {}).values():
            found.fill_(1.0)
