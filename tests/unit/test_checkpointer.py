"""The checkpointer: writes in version order, older snapshots dropped, failed writes counted by reason."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from ps_common.errors import CheckpointError
from ps_server.checkpoint.checkpointer import Checkpointer, CheckpointFailures
from ps_server.checkpoint.files import CheckpointStore
from ps_server.metrics import CHECKPOINT_FAILURE_REASONS, ServerMetrics


class MovingShard:
    """The part of a Shard the checkpointer uses; ``export_state`` advances the version first when
    ``moving`` (a shard that trains between snapshots)."""

    def __init__(self, version: int = 0, moving: bool = False) -> None:
        self.shard_index = 0
        self.checkpoint_every = 0
        self.on_snapshot: Callable[[int, dict[str, Any]], None] | None = None
        self.last_checkpoint_version: int | None = None
        self.version = version
        self.moving = moving
        self._lock = threading.Lock()

    def checkpointed(self, version: int) -> None:
        self.last_checkpoint_version = version

    def export_state(self) -> dict[str, Any]:
        with self._lock:
            self.version += self.moving
            return {"version": self.version, "w": torch.full((100,), float(self.version))}


class RecordingStore(CheckpointStore):
    """A store that records the versions it was asked to save, in order."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.saved: list[int] = []

    def save(self, state: Any, version: int) -> Path:
        self.saved.append(version)
        return super().save(state, version)


def started(store: CheckpointStore, shard: MovingShard, metrics: ServerMetrics | None) -> Checkpointer:
    """A checkpointer of ``shard`` with its writer thread running."""
    checkpointer = Checkpointer(store, metrics)
    checkpointer.attach(shard)  # type: ignore[arg-type]
    checkpointer.start()
    return checkpointer


def failures_by_reason(metrics: ServerMetrics) -> dict[str, float]:
    return {
        s.labels["reason"]: s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == "ps_checkpoint_failures_total"
    }


def test_a_snapshot_older_than_the_newest_checkpoint_is_dropped(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path, 0, keep=3)
    shard = MovingShard(version=5)
    checkpointer = started(store, shard, metrics=None)
    assert checkpointer.checkpoint_now()[0] == 5
    checkpointer.offer(3, {"version": 3})  # taken before version 5, handed over after it was written
    checkpointer.close(final=False)  # finishes the waiting snapshot
    assert store.saved == [5]
    assert [c.version for c in store.checkpoints()] == [5] and shard.last_checkpoint_version == 5


def test_parallel_checkpoint_now_writes_in_version_order_and_shares_writes(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path, 0, keep=2)
    shard = MovingShard(moving=True)
    checkpointer = started(store, shard, metrics=None)
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = [f.result(timeout=60) for f in [pool.submit(checkpointer.checkpoint_now) for _ in range(40)]]
    checkpointer.close(final=False)
    assert store.saved == sorted(set(store.saved)) and len(store.saved) <= 40
    newest = store.saved[-1]
    assert [c.version for c in store.checkpoints()] == store.saved[-2:]
    for version, path, _ in answers:  # each acknowledged file is there, or 2 newer ones are
        assert path.exists() or sum(v > version for v in store.saved) >= 2
    assert shard.last_checkpoint_version == newest


def test_failed_writes_are_counted_by_reason_and_shown_until_a_write_succeeds(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    store = CheckpointStore(directory, 0)
    metrics = ServerMetrics(CollectorRegistry())
    shard = MovingShard(moving=True)
    checkpointer = started(store, shard, metrics=metrics)
    assert checkpointer.failures() == CheckpointFailures(0, "")
    assert failures_by_reason(metrics) == dict.fromkeys(CHECKPOINT_FAILURE_REASONS, 0.0)
    directory.write_text("a file where the directory should be")
    for _ in range(2):
        with pytest.raises(CheckpointError, match="File exists; make it a directory") as info:
            checkpointer.checkpoint_now()
    assert checkpointer.failures() == CheckpointFailures(2, str(info.value))
    assert failures_by_reason(metrics)["not_a_directory"] == 2
    directory.unlink()
    version, path, _ = checkpointer.checkpoint_now()
    assert path.exists() and checkpointer.failures() == CheckpointFailures(2, "")
    assert shard.last_checkpoint_version == version

    shutil.rmtree(directory)
    directory.write_text("a file again")
    checkpointer.close(final=True)
    assert checkpointer.final_error is not None and "File exists" in checkpointer.final_error
    assert checkpointer.failures().count == 3 and failures_by_reason(metrics)["not_a_directory"] == 3


def test_the_newest_checkpoint_time_is_exported_when_written_and_when_resumed(tmp_path: Path) -> None:
    metrics = ServerMetrics(CollectorRegistry())
    checkpointer = started(CheckpointStore(tmp_path, 0), MovingShard(version=7), metrics)
    assert metrics.registry.get_sample_value("ps_last_checkpoint_timestamp_seconds") == 0
    before = time.time()
    version, path, _ = checkpointer.checkpoint_now()
    assert before <= metrics.registry.get_sample_value("ps_last_checkpoint_timestamp_seconds") <= time.time()
    checkpointer.close(final=False)
    os.utime(path, (1_000_000.0, 1_000_000.0))  # as if written long ago

    resumed = ServerMetrics(CollectorRegistry())  # a restarted shard: the time of the file it resumes from
    restarted = Checkpointer(CheckpointStore(tmp_path, 0), resumed)
    shard = MovingShard()
    shard.restore = lambda state: None  # type: ignore[attr-defined]
    restarted.attach(shard)  # type: ignore[arg-type]
    assert restarted.resume() == version == 7
    assert resumed.registry.get_sample_value("ps_last_checkpoint_timestamp_seconds") == 1_000_000.0
    assert resumed.registry.get_sample_value("ps_last_checkpoint_version") == 7
