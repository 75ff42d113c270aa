"""When a shard checkpoints: every V versions (snapshot under the shard's lock, written by a thread),
on demand (Admin/Checkpoint), on SIGTERM; and resuming from the newest complete checkpoint."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from ps_server.checkpoint import CheckpointStore
from ps_server.core.errors import CheckpointError, NotInitializedError
from ps_server.metrics import ServerMetrics
from ps_server.shard import Shard

log = logging.getLogger(__name__)


class Checkpointer:
    """Writes ``shard``'s snapshots to ``store`` off the request path.

    Snapshots are taken by the shard at exact versions (``every``), so in sync mode every shard
    checkpoints the same rounds; if a write is still running when the next snapshot arrives, the
    newer one replaces the waiting one (the slow disk skips versions, never blocks training).

    Args:
        store: where checkpoints go.
        shard: the state to save and restore.
        every: checkpoint every ``every`` versions; 0 only on demand and at shutdown.
        metrics: records ``ps_checkpoint_duration_seconds`` and ``ps_last_checkpoint_version``.
    """

    def __init__(self, store: CheckpointStore, shard: Shard, every: int, metrics: ServerMetrics | None) -> None:
        self.store = store
        self.shard = shard
        self.metrics = metrics
        self._cond = threading.Condition()
        self._waiting: tuple[int, dict[str, Any]] | None = None
        self._closed = False
        self._write_lock = threading.Lock()
        shard.checkpoint_every = every
        shard.on_snapshot = self.offer
        self._thread = threading.Thread(target=self._run, name=f"checkpointer-{shard.shard_index}", daemon=True)
        self._thread.start()

    def resume(self) -> int | None:
        """Restore the newest complete checkpoint, if any; returns its version.

        Raises:
            CheckpointError: checkpoints exist but none loads, or one is of another cluster shape.
        """
        latest = self.store.load_latest()
        if latest is None:
            return None
        version, state = latest
        self.shard.restore(state)
        if self.metrics is not None:
            self.metrics.last_checkpoint_version.set(version)
        return version

    def offer(self, version: int, state: dict[str, Any]) -> None:
        """Queue a snapshot for writing (called by the shard under its lock; never blocks on disk)."""
        with self._cond:
            self._waiting = (version, state)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._closed:
                    self._cond.wait()
                if self._waiting is None:
                    return
                version, state = self._waiting
                self._waiting = None
            try:
                self._write(version, state)
            except CheckpointError as exc:
                log.error("shard %d: checkpoint at version %d failed: %s", self.shard.shard_index, version, exc)

    def _write(self, version: int, state: dict[str, Any]) -> tuple[Path, float]:
        with self._write_lock:
            started = time.perf_counter()
            path = self.store.save(state, version)
            seconds = time.perf_counter() - started
        self.shard.last_checkpoint_version = version
        if self.metrics is not None:
            self.metrics.observe_checkpoint(version, seconds)
        log.info(
            "shard %d: checkpoint at version %d written in %.3f s (%s)", self.shard.shard_index, version, seconds, path
        )
        return path, seconds

    def checkpoint_now(self) -> tuple[int, Path, float]:
        """Snapshot and write at once; returns (version, path, seconds) when it is durable.

        Raises:
            NotInitializedError: nothing to save yet. CheckpointError: the write failed.
        """
        state = self.shard.export_state()
        version = int(state["version"])
        path, seconds = self._write(version, state)
        return version, path, seconds

    def close(self, final: bool = True) -> None:
        """Finish the waiting write, then (``final``) write the current state once more."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=600)
        if final:
            try:
                self.checkpoint_now()
            except NotInitializedError:
                pass
            except CheckpointError as exc:
                log.error("shard %d: final checkpoint failed: %s", self.shard.shard_index, exc)
