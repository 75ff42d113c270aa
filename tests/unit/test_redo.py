"""The redo log (ps_worker/redo.py): what a rank keeps to push a restarted shard's lost rounds again."""

from __future__ import annotations

import pytest
import torch

from ps_common import frames
from ps_worker.redo import LostRoundsError, RedoLog


def outs(value: float, n: int = 4) -> list[list[frames.OutPartition]]:
    """One round's push to 2 shards: ``n`` float32 values each (16 bytes for n = 4)."""
    return [[frames.OutPartition("w", k * n, n, torch.full((n,), value + k))] for k in range(2)]


def test_nothing_is_kept_while_no_shard_can_lose_a_round() -> None:
    log = RedoLog(2)
    log.record(0, outs(1.0), [{"lr": 0.1}], False)
    assert not log.active and log.entries == {} and log.nbytes == 0


def test_a_round_is_kept_as_it_went_on_the_wire_not_as_the_gradient_changes_after() -> None:
    log = RedoLog(2)
    log.checkpointed(0, 0)
    pushed = outs(1.0)
    log.record(0, pushed, [{"lr": 0.1}], skip=True, samples=7)
    pushed[0][0].values.zero_()  # zero_grad() after the step
    (entry,) = log.rounds(0, 0, 1)
    assert entry.outs[0][0].values.tolist() == [1.0] * 4
    assert entry.outs[1] == []  # shard 1 loses no answered round: nothing kept of it
    assert (entry.hyperparameters, entry.skip, entry.samples, entry.nbytes) == ([{"lr": 0.1}], True, 7, 16)


def test_rounds_every_shard_has_on_disk_are_dropped() -> None:
    log = RedoLog(2)
    log.checkpointed(0, 0)
    log.checkpointed(1, 0)
    for r in range(6):
        log.record(r, outs(float(r)), [], False)
    log.checkpointed(0, 4)
    assert sorted(log.entries) == list(range(6))  # shard 1 may still go back to 0
    log.checkpointed(1, 3)
    assert sorted(log.entries) == [3, 4, 5] and log.nbytes == 3 * 32
    assert [e.round for e in log.rounds(1, 3, 6)] == [3, 4, 5]
    log.checkpointed(1, None)  # durable now: only shard 0's floor counts
    assert sorted(log.entries) == [4, 5]


def test_the_log_is_bounded_in_bytes_and_a_dropped_round_is_named() -> None:
    log = RedoLog(2, max_bytes=3 * 32)
    log.checkpointed(0, 0)
    log.checkpointed(1, 0)
    for r in range(5):
        log.record(r, outs(float(r)), [], False)
    assert sorted(log.entries) == [2, 3, 4] and log.nbytes <= 3 * 32
    with pytest.raises(LostRoundsError, match=r"rounds 0\.\.1: the redo log dropped .*--redo-bytes"):
        log.rounds(1, 0, 5)
    with pytest.raises(LostRoundsError, match="did not push them"):
        log.rounds(1, 4, 7)


def test_a_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="redo_bytes must be >= 0"):
        RedoLog(2, max_bytes=-1)
