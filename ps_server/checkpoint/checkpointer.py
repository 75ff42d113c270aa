"""When a shard checkpoints: every V versions (snapshot under the shard's lock, written by a thread),
on demand (Admin/Checkpoint), on SIGTERM; and resuming from the newest complete checkpoint.

Writes are ordered by version: one at a time, a snapshot older than the newest checkpoint written is
dropped, and an on-demand snapshot is taken only once the writes before it are done, so a write never
replaces a newer checkpoint and ``last_checkpoint_version`` never goes back. A failed write is
logged, counted by reason (``ps_checkpoint_failures_total``) and kept for GetStatus.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ps_common.errors import CheckpointError, NotInitializedError
from ps_server.checkpoint.failures import failure_reason
from ps_server.checkpoint.files import CheckpointStore
from ps_server.metrics import ServerMetrics
from ps_server.shard.shard import Shard
from ps_server.shard.state import shard_count_refusal

log = logging.getLogger(__name__)

CLOSE_TIMEOUT = 600.0
"""Seconds :meth:`Checkpointer.close` waits for the write in progress (a big model on a slow disk)."""


@dataclass(frozen=True)
class CheckpointFailures:
    """Failed checkpoint writes of a shard since it started (for GetStatus).

    Attributes:
        count: writes that failed (periodic, on demand and final).
        last_error: the message of the newest write if it failed ("" when none failed or the newest
            write succeeded); says "No space left on device" when that is the cause.
    """

    count: int = 0
    last_error: str = ""


class Checkpointer:
    """Writes a shard's snapshots to ``store`` off the request path, in version order.

    The shard takes its snapshots at exact versions (built with ``Shard(checkpoint_every=V,
    on_snapshot=checkpointer.offer)``), so in sync mode every shard checkpoints the same rounds; if
    a write is still running when the next snapshot arrives, the newer one replaces the waiting one
    (the slow disk skips versions, never blocks training).

    Lifecycle: construct (starts nothing), :meth:`attach` the shard, :meth:`resume`, :meth:`start`
    the writer thread, and :meth:`close` (joins the writer, then writes the final checkpoint).

    Args:
        store: where checkpoints go; its ``shard_index`` names the writer thread
            (``checkpointer-{k}``) and the log lines.
        metrics: records ``ps_checkpoint_duration_seconds``, ``ps_last_checkpoint_version`` and
            ``ps_checkpoint_failures_total``.
    """

    def __init__(self, store: CheckpointStore, metrics: ServerMetrics | None = None) -> None:
        self.store = store
        self.metrics = metrics
        self._shard: Shard | None = None
        self._cond = threading.Condition()
        self._waiting: tuple[int, dict[str, Any]] | None = None
        self._closed = False
        self._asked = 0  # checkpoint_now calls so far (under _cond)
        self._write_lock = threading.Lock()
        # Under _write_lock: the newest version written or resumed from; the answer of the newest
        # on-demand write (its result, or its error's message: an exception would keep the snapshot
        # alive through its traceback) with the number of calls its snapshot covers.
        self._newest: int | None = None
        self._answer: tuple[int, tuple[int, Path, float] | str] | None = None
        self._failures = CheckpointFailures()
        self._thread: threading.Thread | None = None
        self.final_error: str | None = None
        """Set by :meth:`close` when the final checkpoint failed (the process should exit non-zero)."""

    @property
    def shard(self) -> Shard:
        """The attached shard.

        Raises:
            RuntimeError: no shard was attached yet.
        """
        if self._shard is None:
            raise RuntimeError("Checkpointer has no shard: call attach(shard) first.")
        return self._shard

    def attach(self, shard: Shard) -> None:
        """Save and restore ``shard`` (whose ``on_snapshot`` should be :meth:`offer`); once, first."""
        self._shard = shard

    def start(self) -> None:
        """Start the writer thread ``checkpointer-{k}`` (joined by :meth:`close`); idempotent."""
        with self._cond:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(
                target=self._run, name=f"checkpointer-{self.store.shard_index}", daemon=True
            )
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
        plan = state.get("plan")  # not a dict: the shard's restore names what is wrong (checkpoint.checks)
        saved = plan.get("num_shards") if isinstance(plan, dict) else None
        if saved is not None and saved != self.shard.num_shards:  # the same refusal, naming the directory
            raise CheckpointError(shard_count_refusal(saved, self.shard.num_shards, self.store.directory))
        self.shard.restore(state)
        with self._write_lock:
            self._newest = version
        if self.metrics is not None:
            self.metrics.observe_resume(version, self._written_at(version))
        return version

    def _written_at(self, version: int) -> float | None:
        """Modification time (Unix seconds) of this shard's checkpoint file of ``version``; None if unreadable."""
        try:
            return next((c.path.stat().st_mtime for c in self.store.checkpoints() if c.version == version), None)
        except (OSError, CheckpointError):
            return None

    def failures(self) -> CheckpointFailures:
        """Failed writes so far and the newest write's error."""
        with self._cond:
            return self._failures

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
            with self._write_lock:
                if self._newest is not None and version <= self._newest:
                    log.debug(
                        "shard %d: snapshot at version %d dropped: version %d is already written",
                        self.store.shard_index,
                        version,
                        self._newest,
                    )
                    continue
                with contextlib.suppress(Exception):  # counted and logged by _write; the next one tries again
                    self._write(version, state)

    def _write(self, version: int, state: dict[str, Any]) -> tuple[Path, float]:
        """Write one snapshot (caller holds ``_write_lock``); a failure is counted, logged and raised.

        Raises:
            CheckpointError: the store could not write it (a TypeError or ValueError of the store,
                a bug, is raised as is).
        """
        started = time.perf_counter()
        try:
            path = self.store.save(state, version)
        except Exception as exc:
            reason = failure_reason(exc)
            message = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
            with self._cond:
                self._failures = CheckpointFailures(self._failures.count + 1, message)
            if self.metrics is not None:
                self.metrics.checkpoint_failures.labels(reason).inc()
            log.error(
                "shard %d: checkpoint at version %d failed (%s): %s",
                self.store.shard_index,
                version,
                reason,
                message,
                exc_info=not isinstance(exc, CheckpointError),
            )
            raise
        seconds = time.perf_counter() - started
        self._newest = version if self._newest is None else max(self._newest, version)
        self.shard.checkpointed(self._newest)
        with self._cond:
            if self._failures.last_error:
                self._failures = CheckpointFailures(self._failures.count, "")
        if self.metrics is not None:
            self.metrics.observe_checkpoint(self._newest, seconds)
        log.info(
            "shard %d: checkpoint at version %d written in %.3f s (%s)", self.store.shard_index, version, seconds, path
        )
        return path, seconds

    def checkpoint_now(self) -> tuple[int, Path, float]:
        """Snapshot and write at once; returns (version, path, seconds) when it is durable.

        The snapshot is taken once the writes before it are done, so it is at least as new as every
        checkpoint on disk. Calls that arrive while a write is running share the next write: each
        gets the answer of the first write whose snapshot was taken after it was called.

        Raises:
            NotInitializedError: nothing to save yet. CheckpointError: the write failed.
        """
        with self._cond:
            self._asked += 1
            ticket = self._asked
        with self._write_lock:
            if self._answer is not None and self._answer[0] >= ticket:
                answer = self._answer[1]
                if isinstance(answer, str):
                    raise CheckpointError(answer)
                return answer
            with self._cond:
                covers = self._asked
            state = self.shard.export_state()
            version = int(state["version"])
            try:
                path, seconds = self._write(version, state)
            except CheckpointError as exc:
                self._answer = (covers, str(exc))
                raise
            self._answer = (covers, (version, path, seconds))
            return version, path, seconds

    def close(self, final: bool = True) -> None:
        """Finish the waiting write and join the writer thread (within ``CLOSE_TIMEOUT`` seconds,
        logged when it did not end), then (``final``) write the current state once more; a failed
        final write sets :attr:`final_error` (never raises, so the shard still stops)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=CLOSE_TIMEOUT)
            if thread.is_alive():
                log.warning(
                    "shard %d: checkpoint writer did not end within %.0f s", self.store.shard_index, CLOSE_TIMEOUT
                )
        if final:
            try:
                self.checkpoint_now()
            except NotInitializedError:
                pass
            except Exception as exc:
                self.final_error = str(exc)
