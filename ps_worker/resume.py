"""Whole-job resume on the worker side: where in the data a rank restarts, and its random state.

A job restarted from its shards' checkpoints continues at the cluster's clock (``client.clock``
after ``init``; for EASGD ``client.exchanges`` times the communication period): a rank that has run
``clock`` steps of ``batches_per_epoch`` batches each has consumed ``clock // batches_per_epoch``
whole epochs and ``clock % batches_per_epoch`` batches of the next. Skipping exactly those keeps the
data order of an uninterrupted run (``DistributedSampler`` shuffles by ``seed + epoch``), and
:func:`reseed` makes the random state at the resume point a function of (seed, rank, step), so two
resumptions at the same step draw the same numbers. ``--steps`` (``PS_STEPS``) counts the whole
job: a resumed rank runs ``steps - clock`` more.

User scripts call these too::

    client = PSClient.from_env(model)
    start = resume_step(client)
    sampler = ResumableSampler(DistributedSampler(data, client.num_workers, client.rank, seed=seed),
                               batch_size, start_step=start)
    loader = DataLoader(data, batch_size, sampler=sampler, drop_last=True)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeVar

import torch
from torch.utils.data import Sampler

T = TypeVar("T")


class _Epochs(Protocol):
    def set_epoch(self, epoch: int) -> None: ...


def resume_position(clock: int, batches_per_epoch: int) -> tuple[int, int]:
    """The (epoch, offset in batches) of step ``clock``: the first batch not yet consumed.

    Raises:
        ValueError: ``clock < 0`` or ``batches_per_epoch < 1`` (a data set smaller than one batch per rank).
    """
    if clock < 0:
        raise ValueError(f"clock must be >= 0, got {clock}.")
    if batches_per_epoch < 1:
        raise ValueError(
            f"batches_per_epoch must be >= 1, got {batches_per_epoch}: the data set has less than one batch per rank."
        )
    return divmod(clock, batches_per_epoch)


def resume_step(client: Any) -> int:
    """The step a rank resumes at after ``client.init`` (0 on a fresh job), as its mode counts steps
    (``ps_worker.consistency``): its clock; EASGD, its exchanges times the communication period;
    diloco, the inner step the open outer round starts at, counted with each round's own H // F
    across live changes (:mod:`ps_common.outer_rounds`)."""
    return int(client.worker_mode.progress(client.session, client.settings))


def reseed(seed: int, rank: int, step: int) -> None:
    """Seed torch's default generator (CPU and CUDA) from (seed, rank, step) for a rank resuming at
    ``step > 0`` (dropout masks and random augmentations then repeat between resumptions). A fresh
    start (step 0) keeps the caller's ``torch.manual_seed(seed)``: nothing changes for it."""
    if step > 0:
        torch.manual_seed((seed * 1_000_003 + rank) * 1_000_003 + step)


def batches(loader: Iterable[T], sampler: _Epochs, start_step: int = 0, first_epoch: int = 0) -> Iterator[T]:
    """Endless batches of ``loader``: each pass over the data is a new sampler epoch (new shuffle),
    counted from ``first_epoch``, starting at step ``start_step``'s epoch and skipping the batches
    of that epoch already consumed. With ``start_step=0`` it is exactly ``set_epoch(first_epoch),
    loader, set_epoch(first_epoch + 1), loader, ...`` (a resized job starts its passes at the
    resize's round).

    Raises:
        ValueError: see :func:`resume_position` (``len(loader)`` is the batches per epoch).
    """
    epoch, offset = resume_position(start_step, len(loader)) if start_step else (0, 0)  # type: ignore[arg-type]
    epoch += first_epoch
    while True:
        sampler.set_epoch(epoch)
        if offset:
            yield from itertools.islice(loader, offset, None)
            offset = 0
        else:
            yield from loader
        epoch += 1


class ResumableSampler(Sampler[int]):
    """A ``DistributedSampler`` (or any sampler with ``set_epoch``) that starts at a step: in the
    resume epoch it yields the indices after the ``offset * batch_size`` already consumed, without
    loading them; :meth:`epochs` counts from the resume epoch and sets each. Use it with a
    ``DataLoader(..., batch_size=batch_size, drop_last=True)``.

    Args:
        sampler: the rank's sampler; its length per epoch sets the batches per epoch
            (``len(sampler) // batch_size``).
        batch_size: samples per step.
        start_step: steps the rank has already run (:func:`resume_step`).

    Raises:
        ValueError: see :func:`resume_position`.
    """

    def __init__(self, sampler: Any, batch_size: int, start_step: int = 0) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.batches_per_epoch = len(sampler) // batch_size
        self.start_epoch, self.offset = resume_position(start_step, self.batches_per_epoch)
        self.epoch = self.start_epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def _skip(self) -> int:
        return self.offset * self.batch_size if self.epoch == self.start_epoch else 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self._skip(), None)

    def __len__(self) -> int:
        return len(self.sampler) - self._skip()

    def epochs(self) -> Iterator[int]:
        """The epochs from the resume one on, endless; each is set on the sampler before it is yielded."""
        for epoch in itertools.count(self.start_epoch):
            self.set_epoch(epoch)
            yield epoch
