"""The training loop of ``ps-worker``: DistributedSampler data, DistributedOptimizer steps."""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ps_common import tracing
from ps_common.optimizer import OptimizerSpec
from ps_worker import model_file, resume
from ps_worker.client import PSClient
from ps_worker.metrics import WorkerMetrics
from ps_worker.optimizer import DistributedOptimizer
from ps_worker.tables.prefetch import RowPrefetcher
from ps_worker.tensorboard import TrainingLog
from ps_worker.workloads.base import Workload

log = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    """What one worker reports at the end (bytes are payload bytes; seconds are wall time)."""

    rank: int
    steps: int
    final_loss: float | None
    """Mean loss of the last 10 steps; None when this run trained no step."""
    accuracy: float | None
    eval_loss: float | None
    wall_seconds: float
    steps_per_second: float
    samples_per_second: float
    pushed_bytes: int
    pulled_bytes: int
    version: int
    params_sha256: str
    mode: str = "sync"
    clock: int = 0
    refused_pushes: int = 0
    dropped_pushes: int = 0
    staleness_p50: float = 0.0
    staleness_p90: float = 0.0
    staleness_max: int = 0
    first_step: int = 0
    """Step this process started at: a restarted rank resumes at the cluster's clock."""
    bits_per_char: float | None = None
    """charlm: held-out bits per character (loss / ln 2)."""
    auc: float | None = None
    """ctr: held-out ROC AUC of the model's click probabilities."""
    ground_truth_auc: float | None = None
    """ctr: held-out ROC AUC of the click log's hidden probabilities (the best achievable)."""
    resized_out_at: int | None = None
    """The step at which a resize to fewer workers ended this rank (None: it ran to the end)."""
    num_workers: int = 0
    """The cluster's worker count when this rank finished."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def params_sha256(model: torch.nn.Module) -> str:
    """sha256 over every parameter's raw bytes in declaration order (bitwise identity check)."""
    h = hashlib.sha256()
    for key, p in model.named_parameters():
        h.update(key.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(
    workload: Workload,
    client: PSClient,
    *,
    steps: int,
    batch_size: int,
    optimizer: dict[str, Any],
    seed: int = 0,
    device: str = "cpu",
    on_step: Callable[[int, float], None] | None = None,
    on_start: Callable[[int, int], None] | None = None,
    before_push: Callable[[int], None] | None = None,
    metrics: WorkerMetrics | None = None,
    overlap: bool = False,
    elastic_lr: str = "none",
    curves: TrainingLog | None = None,
    init_from: str = "",
) -> TrainSummary:
    """Initialize through ``client`` and train ``steps`` steps.

    Args:
        workload: model, data, loss, evaluation.
        client: not yet initialized; closed by the caller.
        steps: optimizer steps (pushes) of this worker.
        batch_size: samples per step on this worker.
        optimizer: server-side optimizer spec (used by rank 0's Init).
        seed: model initialization and sampler shuffling seed (same on every rank).
        device: where the model runs (``cpu`` or ``cuda``).
        on_step: called with (step, loss) after every step.
        on_start: called with (first step, steps) once initialized, just before the first step
            (a restarted rank's first step is the cluster's clock).
        before_push: called with the step before each push (straggler injection).
        metrics: where to record each step's seconds and loss; None records nothing.
        overlap: push gradients while backward runs (``DistributedOptimizer(overlap=True)``).
        elastic_lr: "linear" scales every group's learning rate by the cluster's worker count over
            the shards' ``--num-workers`` (Goyal et al. 2017, the linear scaling rule), from the start
            and at each resize; "none" keeps it.
        curves: TensorBoard curves of this rank (:class:`~ps_worker.tensorboard.TrainingLog`): every
            step's loss, seconds, learning rate, staleness and bytes, and the held-out scores at the
            last step; the caller closes it. None records nothing.
        init_from: a model file whose dense parameters and table rows the model starts from (rank
            0's reach the shards at Init and InitTables; :func:`ps_worker.model_file.init_from`); ""
            starts from ``seed``.

    A resize (``ps-admin resize``) reaches the loop through the client: from the resize's round
    (sync; at once in the other modes) the data is re-sharded — a ``DistributedSampler`` with the
    new ``num_replicas`` starts a new pass at sampler epoch = that round, and a rank started later
    skips the batches the others consumed since — and a rank the resize left out stops.
    """
    torch.manual_seed(seed)
    model = workload.model()
    if init_from:
        model_file.init_from(model, init_from)
    model = model.to(device)
    client.init(model, optimizer)  # first: a wrong or unreachable shard address is named before data loads
    train_set, held_out = workload.datasets()
    local = None
    mode = client.worker_mode
    if mode.local_optimizer:  # EASGD workers step locally with the same optimizer settings
        kwargs = {k: v for k, v in optimizer.items() if k != "name"}
        local = OptimizerSpec(str(optimizer["name"]), kwargs).build(model.parameters())
    opt = DistributedOptimizer(model, client, local_optimizer=local, overlap=overlap)
    losses: list[float] = []
    model.train()
    # a restarted rank resumes at the cluster's clock: --steps counts the rank's whole run
    resume_at = resume.resume_step(client)
    first = min(resume_at, steps)
    resume.reseed(seed, client.rank, first)  # and skips the batches already consumed
    sampler, data = shard_data(train_set, batch_size, seed, client, first, model)
    lr_factor = elastic_factor(client, elastic_lr)
    scale_lr(opt, lr_factor)
    resized_out = None
    if first >= steps:
        log.warning(
            "rank %d: nothing to do: the cluster is at step %d, and --steps is %d (a finished job's checkpoints?); "
            "start the shards with a new --checkpoint-dir or raise --steps",
            client.rank,
            resume_at,
            steps,
        )
    if on_start is not None:
        on_start(first, steps)
    start = time.perf_counter()  # training only: Init and the first pull are start-up
    step, iterations, limit = first, 0, 2 * (steps - first) + 100
    while step < steps:
        if not client.session.in_cluster(step):
            resized_out = step
            log.warning(
                "rank %d: resized out of the job at step %d (%d workers now)", client.rank, step, client.num_workers
            )
            break
        if sampler.num_replicas != client.num_workers and resize_due(client, step):
            sampler, data = shard_data(train_set, batch_size, seed, client, step, model)
            factor = elastic_factor(client, elastic_lr)
            scale_lr(opt, factor / lr_factor)
            lr_factor = factor
        step_start = time.perf_counter()
        with tracing.span("step", rank=client.rank, step=step):  # off: a no-op (ps_common.tracing)
            x, y = next(data)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            loss = workload.loss(model, x, y)
            loss.backward()
            if before_push is not None:
                before_push(step)
            opt.step()
        losses.append(float(loss.detach()))
        seconds = time.perf_counter() - step_start
        if metrics is not None:
            metrics.step_duration.observe(seconds)
            metrics.loss.set(losses[-1])
        # sync: the round the rank holds next, the same on every rank (WorkerMode.next_step)
        step = client.worker_mode.next_step(step, client.version)
        if curves is not None:
            curves.log_step(opt, loss=losses[-1], step=step, step_seconds=seconds)
        iterations += 1
        if iterations > limit:
            raise RuntimeError(
                f"rank {client.rank}: {iterations} steps ran but the rounds reached only {step} of {steps}: "
                "the shards keep refusing this rank's rounds (see the log)"
            )
        if on_step is not None:
            on_step(step, losses[-1])
    wall = time.perf_counter() - start
    client.worker_mode.finish(client, model)  # easgd: the center is the model; local x only explores around it
    model.eval()
    scores = workload.evaluate(model.cpu(), held_out)
    if curves is not None:
        curves.log_eval(scores, step)
    tail = losses[-10:]
    return TrainSummary(
        rank=client.rank,
        steps=steps,
        final_loss=sum(tail) / len(tail) if tail else None,
        accuracy=scores.get("accuracy"),
        eval_loss=scores.get("loss"),
        wall_seconds=wall,
        steps_per_second=len(losses) / wall if wall > 0 else 0.0,
        samples_per_second=len(losses) * batch_size / wall if wall > 0 else 0.0,
        pushed_bytes=client.pushed_bytes,
        pulled_bytes=client.pulled_bytes,
        version=client.version,
        params_sha256=params_sha256(model),
        mode=client.mode,
        clock=client.worker_mode.shard_clock(client.session),
        refused_pushes=client.refused_pushes,
        dropped_pushes=client.dropped_pushes,
        staleness_p50=quantile(client.staleness, 0.5),
        staleness_p90=quantile(client.staleness, 0.9),
        staleness_max=max(client.staleness, default=0),
        first_step=first,
        bits_per_char=scores.get("bits_per_char"),
        auc=scores.get("auc"),
        ground_truth_auc=scores.get("ground_truth_auc"),
        resized_out_at=resized_out,
        num_workers=client.num_workers,
    )


def shard_data(
    train_set: Any, batch_size: int, seed: int, client: PSClient, step: int, model: Any = None
) -> tuple[Any, Any]:
    """This rank's sampler and endless batches from ``step`` on, for the cluster's worker count:
    before any resize, the passes of a fixed-size job (:func:`resume.batches`); from a resize's round
    ``V`` on, passes of ``DistributedSampler(num_replicas=num_workers)`` starting at sampler epoch
    ``V`` (every rank, however late it started, reads the same sequence; diloco counts the steps
    from round V's first inner step); with the rows of each
    batch prefetched when ``model`` has ``table_inputs`` (:func:`prefetched`)."""
    sampler = DistributedSampler(
        train_set, num_replicas=client.num_workers, rank=client.rank, shuffle=True, seed=seed, drop_last=True
    )
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler, drop_last=True)
    since = int(client.session.membership.resize_version)
    changes = client.session.membership.config_changes  # diloco: the round's first inner step
    start = client.worker_mode.round_start(since, client.settings, changes)
    if since and step >= start:
        return sampler, prefetched(client, model, resume.batches(loader, sampler, step - start, first_epoch=since))
    return sampler, prefetched(client, model, resume.batches(loader, sampler, step))


def prefetched(client: PSClient, model: Any, batches: Iterator[Any]) -> Iterator[Any]:
    """``batches`` with each one's embedding rows pulled while the step before it runs, when the
    model says which rows a batch looks up (``table_inputs(x)``, as the ctr workload's DLRM;
    ``ps_worker.tables.prefetch``); otherwise ``batches`` as they are."""
    inputs = getattr(model, "table_inputs", None)
    if client.tables is None or inputs is None:
        return batches
    return iter(RowPrefetcher(client, lambda batch: inputs(batch[0])).wrap(batches))


def resize_due(client: PSClient, step: int) -> bool:
    """Whether a new worker count holds at ``step``: from its round in sync and diloco (the outer
    round the inner steps lead to), at once otherwise."""
    mode = client.worker_mode
    return not mode.resize_pending(mode.resize_clock(client.session, step), client.session.membership.resize_version)


def elastic_factor(client: PSClient, elastic_lr: str) -> float:
    """The learning-rate factor ``elastic_lr`` asks for now: 1, or (linear) the worker count over
    the shards' ``--num-workers``."""
    configured = client.session.membership.configured_num_workers
    if elastic_lr != "linear" or not configured:
        return 1.0
    return client.num_workers / configured


def scale_lr(opt: torch.optim.Optimizer, factor: float) -> None:
    """Multiply every parameter group's learning rate by ``factor`` (pushes carry it)."""
    if factor != 1.0:
        for group in opt.param_groups:
            group["lr"] = group["lr"] * factor


def quantile(counts: Counter[int], q: float) -> float:
    """The q-quantile (nearest rank) of a histogram of integer values; 0 when empty."""
    total = sum(counts.values())
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= q * total:
            return float(value)
    return 0.0
