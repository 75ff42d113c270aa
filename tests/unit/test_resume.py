"""Whole-job resume on the worker side (ps_worker.resume): the batches a resumed rank skips, its random state."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ps_common.modes import ModeSettings
from ps_worker.consistency import worker_mode
from ps_worker.resume import ResumableSampler, batches, reseed, resume_position, resume_step

DATA = TensorDataset(torch.arange(100).float(), torch.arange(100))


def loader(rank: int = 0, batch: int = 8) -> tuple[DataLoader, DistributedSampler]:
    sampler = DistributedSampler(DATA, num_replicas=2, rank=rank, shuffle=True, seed=3, drop_last=True)
    return DataLoader(DATA, batch_size=batch, sampler=sampler, drop_last=True), sampler


def test_resume_position_is_epoch_and_offset() -> None:
    assert resume_position(0, 6) == (0, 0)
    assert resume_position(5, 6) == (0, 5)
    assert resume_position(6, 6) == (1, 0)
    assert resume_position(20, 6) == (3, 2)
    with pytest.raises(ValueError, match="less than one batch per rank"):
        resume_position(3, 0)
    with pytest.raises(ValueError, match="clock must be >= 0"):
        resume_position(-1, 6)


@pytest.mark.parametrize("start", [0, 1, 5, 6, 13])
def test_a_resumed_rank_sees_the_batches_an_uninterrupted_one_would(start: int) -> None:
    """50 samples per rank, batch 8: 6 batches per epoch; steps 0..19 cross three epochs."""
    full_loader, full_sampler = loader()
    full = [y.tolist() for _, y in itertools.islice(batches(full_loader, full_sampler), 20)]
    resumed_loader, resumed_sampler = loader()
    resumed = [y.tolist() for _, y in itertools.islice(batches(resumed_loader, resumed_sampler, start), 20 - start)]
    assert resumed == full[start:]


@pytest.mark.parametrize("start", [0, 4, 6, 15])
def test_resumable_sampler_skips_without_loading(start: int) -> None:
    full_loader, full_sampler = loader(rank=1)
    full = [y.tolist() for _, y in itertools.islice(batches(full_loader, full_sampler), 24)]
    sampler = ResumableSampler(DistributedSampler(DATA, 2, 1, shuffle=True, seed=3, drop_last=True), 8, start)
    data = DataLoader(DATA, batch_size=8, sampler=sampler, drop_last=True)
    seen: list[list[int]] = []
    for epoch in sampler.epochs():
        assert sampler.epoch == epoch
        seen += [y.tolist() for _, y in data]
        if len(seen) >= 24 - start:
            break
    assert seen[: 24 - start] == full[start:]
    assert sampler.batches_per_epoch == 6 and (sampler.start_epoch, sampler.offset) == divmod(start, 6)


def _joined(mode: str, clock: int, exchanges: int, period: int = 10) -> SimpleNamespace:
    """What resume_step reads of a joined PSClient: its mode's worker side, session and settings."""
    return SimpleNamespace(
        worker_mode=worker_mode(mode),
        session=SimpleNamespace(clock=clock, exchanges=exchanges),
        settings=ModeSettings(mode=mode, num_workers=2, communication_period=period),
    )


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_resume_step_is_the_clock(mode: str) -> None:
    assert resume_step(_joined(mode, clock=40, exchanges=0)) == 40


def test_resume_step_counts_easgd_periods() -> None:
    assert resume_step(_joined("easgd", clock=0, exchanges=4, period=10)) == 40


def test_reseed_is_a_function_of_seed_rank_and_step_and_leaves_a_fresh_start_alone() -> None:
    torch.manual_seed(0)
    fresh = torch.rand(3)
    torch.manual_seed(0)
    reseed(0, 1, 0)  # step 0: the caller's seed stays
    assert torch.equal(torch.rand(3), fresh)
    draws = []
    for rank, step in ((1, 40), (1, 40), (0, 40), (1, 41)):
        torch.manual_seed(123)
        reseed(0, rank, step)
        draws.append(torch.rand(3))
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[3])
