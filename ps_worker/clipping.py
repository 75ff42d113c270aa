"""DDP's gradient clipping in sync mode: the round's averaged gradient clipped by its norm over every
shard (``DistributedOptimizer.clip_grad_norm_``; ``docs/architecture.md#7-gradient-path``).

Under DDP, ``torch.nn.utils.clip_grad_norm_`` after backward sees the all-reduced (averaged)
gradient. Here the average is formed on the shards, each over its own partitions, so a clip on the
worker would see this rank's gradient only. A clipped step therefore takes two calls per shard
instead of one PushPull:

1. :meth:`RoundClipper.push` (from ``clip_grad_norm_``): a Push with ``hold_for_clip``. Each shard
   holds the complete round unapplied and answers with the sum of squares of the round's mean over
   its trained partitions (``ClipNorm``). The worker adds them **in shard order** (every rank gets
   the same sums, so every rank computes the same norm and coefficient, bitwise) and returns
   ``total_norm = sqrt(sum)``; ``coefficient = min(1, max_norm / (total_norm + 1e-6))``, as
   ``torch.nn.utils.clip_grad_norm_`` computes it.
2. :meth:`RoundClipper.finish` (from ``step()``): a Pull carrying the coefficient
   (``ClipCoefficient``): the shard scales the mean by the first rank's coefficient, steps its
   optimizer, and every later rank's coefficient must be the same (FAILED_PRECONDITION otherwise).

Only the dense parameters count in the norm (buffers never do); embedding tables' row gradients
are neither counted nor scaled (a warning says so once).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import torch

from ps_proto.v1 import ps_pb2
from ps_worker.client import PSClient
from ps_worker.transport.calls import is_stale

log = logging.getLogger(__name__)

EPS = 1e-6
"""Added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does."""

UNSCALED = 1
"""``torch.amp.grad_scaler.OptState.UNSCALED``: ``GradScaler.unscale_`` ran for this step."""


def check_clip_args(max_norm: float, norm_type: float) -> float:
    """``max_norm`` as a float, once checked.

    Raises:
        ValueError: ``max_norm`` is not a finite number > 0, or ``norm_type`` is not 2.
    """
    value = float(max_norm)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"max_norm must be a finite number > 0, got {max_norm!r}; nothing was pushed.")
    if float(norm_type) != 2.0:
        raise ValueError(
            f"clip_grad_norm_ clips by the L2 norm (norm_type=2.0) on the shards; got norm_type={norm_type!r}. "
            "Nothing was pushed."
        )
    return value


def clip_coefficient(max_norm: float, sums: Sequence[float]) -> tuple[float, float]:
    """The total L2 norm and torch's clipping coefficient from per-shard sums of squares.

    Args:
        max_norm: the largest norm allowed (> 0).
        sums: per shard, in shard order, the sum of squares of its part of the averaged gradient.

    Returns:
        (total_norm, min(1, max_norm / (total_norm + 1e-6))), in float64; the sums are added in
        the order given, so every rank computes the same numbers.
    """
    total = 0.0
    for s in sums:
        total += s
    norm = math.sqrt(total)
    return norm, min(1.0, max_norm / (norm + EPS))


def amp_skip(scaler_state: Mapping[str, Any] | None) -> bool:
    """With a ``GradScaler``: whether its ``unscale_`` found inf/NaN this step (the round is then
    pushed as a skip, as ``scaler.step`` would skip it).

    Args:
        scaler_state: the scaler's per-optimizer state for this optimizer (None: no scaler).

    Raises:
        RuntimeError: ``scaler.unscale_(optimizer)`` did not run before ``clip_grad_norm_``.
    """
    if scaler_state is None:
        return False
    stage = scaler_state.get("stage")
    if getattr(stage, "value", stage) != UNSCALED:
        raise RuntimeError(
            "clip_grad_norm_ with a GradScaler: call scaler.unscale_(optimizer) first (torch's AMP recipe), so "
            "the norm is the true gradient's. Nothing was pushed."
        )
    return any(float(t) > 0 for t in scaler_state.get("found_inf_per_device", {}).values())


class RoundClipper:
    """A sync step clipped on the shards, begun by ``clip_grad_norm_`` and finished by ``step()``.

    Args:
        client: the initialized client of the optimizer.
    """

    def __init__(self, client: PSClient) -> None:
        self.client = client
        self.due = False
        """``clip_grad_norm_`` pushed this step's gradients; ``step()`` finishes the round."""
        self.coefficient: ps_pb2.ClipCoefficient | None = None
        """What the finishing Pull carries (None: the round was skipped or refused)."""
        self.last_norm: float | None = None
        """The total norm of the last clipped round (NaN: skipped or refused)."""
        self._warned_tables = False

    def check_mode(self) -> None:
        """Raises RuntimeError unless the cluster runs sync (only sync averages a round)."""
        worker = self.client.worker_mode
        if worker.local_optimizer:
            raise RuntimeError(
                f"DistributedOptimizer.clip_grad_norm_ clips a sync round's averaged gradient; this cluster runs "
                f"{worker.name}, whose steps are this rank's own local steps: clip them as a single-process script "
                "does, with torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) before step()."
            )
        if not worker.pushes_in_rounds:
            raise RuntimeError(
                f"DistributedOptimizer.clip_grad_norm_ clips a sync round's averaged gradient; this cluster runs "
                f"{worker.name}, where each push is its own update and no average exists. Clip this rank's "
                "gradient with torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) before step() "
                "instead (that is a per-rank clip)."
            )

    def push(
        self,
        grads: Mapping[str, torch.Tensor],
        hyperparameters: Sequence[Mapping[str, float]],
        skip: bool,
        max_norm: float,
    ) -> torch.Tensor:
        """Push the step's gradients holding the round for clipping; returns the round's total norm.

        Args:
            grads: key -> gradient (and buffer values), as a push carries them.
            hyperparameters: per parameter group, the step's values.
            skip: AMP found inf on this rank: the round is skipped on every shard.
            max_norm: the largest norm allowed (checked by :func:`check_clip_args`).

        Returns:
            A 0-dim float32 tensor: the L2 norm of the round's averaged gradient over every dense
            parameter; ``inf`` when the round was skipped (an AMP overflow on some rank), NaN when
            the round was refused as too stale.

        Raises:
            RuntimeError: a previous ``clip_grad_norm_`` was not followed by ``step()``.
            grpc.RpcError: as :meth:`PSClient.push` (nothing is due then).
        """
        if self.due:
            raise RuntimeError(
                "clip_grad_norm_ called twice before step(): the first already pushed this step's gradients."
            )
        client = self.client
        if client.tables is not None and not self._warned_tables:
            self._warned_tables = True
            log.warning(
                "rank %d: clip_grad_norm_ clips the dense parameters' averaged gradient; the embedding tables' row "
                "gradients are not in the norm and are not scaled (DDP would count them)",
                client.rank,
            )
        try:
            replies = client.path.push(grads, hyperparameters, skip, hold=True)
        except grpc.RpcError as exc:
            if not is_stale(exc):
                raise
            log.info("rank %d: clipped push refused (%s); the step pulls", client.rank, exc.details())
            self.due, self.coefficient, self.last_norm = True, None, math.nan
            return torch.tensor(math.nan)
        self.due = True
        if any(r.skipped or not r.HasField("clip") for r in replies):
            self.coefficient, self.last_norm = None, math.inf
            return torch.tensor(math.inf)
        rounds = {r.clip.round for r in replies}
        if len(rounds) != 1:
            raise RuntimeError(f"The shards held different rounds for clipping ({sorted(rounds)}); this is a bug.")
        norm, coefficient = clip_coefficient(max_norm, [r.clip.sum_squares for r in replies])
        self.coefficient = ps_pb2.ClipCoefficient(round=rounds.pop(), coefficient=coefficient)
        self.last_norm = norm
        return torch.tensor(norm, dtype=torch.float32)

    def finish(self, out: Mapping[str, torch.Tensor]) -> int:
        """Step the held round with the coefficient and pull its result into ``out``.

        Returns:
            The lowest version among the shards.

        Raises:
            grpc.RpcError: as :meth:`PSClient.pull`; FAILED_PRECONDITION: another rank sent
            another coefficient for the round.
        """
        coefficient, self.coefficient, self.due = self.coefficient, None, False
        return self.client.path.pull(out, clip=coefficient)
