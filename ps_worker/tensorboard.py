"""TensorBoard training curves of one rank: :class:`TrainingLog` (``ps-worker --tensorboard DIR`` and user scripts).

Each rank writes its own run, ``DIR/rank-R``, so ``tensorboard --logdir DIR`` draws one curve per
rank. The scalars (``docs/operations.md#tensorboard``), each at global step = the rank's step:

==========================  ======================================================================
``train/loss``              mean training loss of the steps since the previous point
``train/step_seconds``      mean wall seconds per step since the previous point (batch, forward,
                            backward, push and pull)
``train/lr_pushed``         sync, async, ssp: the learning rate this rank's pushes carry to the
                            shards' optimizer (what the shards apply, unless ``ps-admin set --lr``
                            changed it since the last change of the worker's own)
``train/lr_local``          easgd, diloco, or a plain torch optimizer: the learning rate of the
                            optimizer stepping on the worker (diloco's inner one; the outer one
                            runs on the shards)
``train/staleness``         async, ssp: mean staleness of this rank's pushes applied since the
                            previous point, in versions (the shards' answer; none in sync mode)
``train/staleness_max``     the largest of those
``comm/pushed_bytes``       bytes this rank pushed so far (``client.pushed_bytes``, as the summary)
``comm/pulled_bytes``       bytes this rank pulled so far (``client.pulled_bytes``)
``eval/NAME``               held-out scores (:meth:`TrainingLog.log_eval`: accuracy, loss, auc...)
==========================  ======================================================================

A parameter group after the first adds ``/groupG`` to its learning rate's tag. Nothing here
imports torch or tensorboard until a :class:`TrainingLog` is made, so the command-line tools'
``--help`` stays fast; without the ``tensorboard`` package, :func:`require` and the constructor
raise :class:`TensorBoardMissing`, which says ``pip install 'grpc-ps[tensorboard]'``.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["INSTALL", "TensorBoardMissing", "TrainingLog", "prepare", "require", "run_dir"]

log = logging.getLogger(__name__)

INSTALL = "pip install 'grpc-ps[tensorboard]'"
"""The command that installs what ``--tensorboard`` needs."""


FLUSH_SECONDS = 10
"""Seconds between the writer's flushes to disk (torch's default, 120, hides a live run's curves for minutes)."""


QUEUE_SCALARS = 1000
"""Scalars waiting for the writer's thread at most (about 125 points); past it a stalled disk drops points."""
CLOSE_SECONDS = 5.0
"""Longest :meth:`TrainingLog.close` waits for the points still queued to reach the disk."""


class TensorBoardMissing(ImportError):
    """The ``tensorboard`` package is not installed (or ``torch.utils.tensorboard`` cannot load it)."""


def require(flag: str = "--tensorboard") -> None:
    """Check, without importing it, that the ``tensorboard`` package is installed.

    Raises:
        TensorBoardMissing: it is not; the message names ``flag`` and :data:`INSTALL`.
    """
    try:
        found = importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise TensorBoardMissing(f"{flag} needs the tensorboard package, which is not installed: {INSTALL}")


def prepare(log_dir: str | os.PathLike[str], every: int, flag: str = "--tensorboard") -> str:
    """Check ``--tensorboard DIR --tensorboard-every N`` before a run starts and create ``DIR``.

    Returns:
        What to tell the user: ``DIR/rank-R (view: tensorboard --logdir DIR)``, DIR absolute.

    Raises:
        TensorBoardMissing: the ``tensorboard`` package is not installed.
        ValueError: ``every`` < 1, or ``DIR`` cannot be created.
    """
    require(flag)
    if every < 1:
        raise ValueError(f"{flag}-every must be >= 1, got {every}.")
    path = Path(log_dir).resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag} {str(log_dir)!r} cannot be created: {exc.strerror or exc}.") from exc
    return f"{path}/rank-R (view: tensorboard --logdir {path})"


def run_dir(log_dir: str | os.PathLike[str], rank: int) -> Path:
    """The directory of rank ``rank``'s run under ``log_dir``: ``log_dir/rank-R``."""
    return Path(log_dir) / f"rank-{rank}"


class TrainingLog:
    """One rank's TensorBoard run: the scalars of the module's table, every ``every`` steps.

    Args:
        log_dir: the job's directory (``tensorboard --logdir`` it); this rank writes ``log_dir/rank-R``.
            None: a log that records nothing (every method returns at once).
        rank: the worker's rank ``R``.
        every: write a point at the first step and then at each multiple of ``every`` (>= 1) a step
            reaches or passes (``every`` 10: steps 1, 10, 20...; :meth:`close` adds the last step); the
            loss and step time are means over the steps since the previous point, so none is dropped.
        writer: a ``SummaryWriter``-like object to write to instead of one made here (tests).

    Best effort: the writer's calls run on a thread of their own behind a bounded queue, so a step
    never waits for the disk. A write that fails (the directory removed or replaced by a file, a full
    disk) logs one WARNING and turns this log off; a disk that stalls fills the queue, and the points
    past it are dropped with one WARNING; :meth:`close` waits at most :data:`CLOSE_SECONDS`. The
    training goes on in every case.

    Cost: between points :meth:`log_step` appends two floats; a point writes up to 8 scalars, about
    0.2 ms of CPU each (tensorboard's event writer computes its checksums in pure Python; measured on
    a loaded 2-core machine), hence a point every 10 steps by default: 0.1-0.2 ms per step, against
    10-20 ms of a digits step there.

    Raises:
        TensorBoardMissing: ``log_dir`` is given and the ``tensorboard`` package is not installed.
        ValueError: ``every`` < 1 or ``rank`` < 0.
    """

    def __init__(
        self, log_dir: str | os.PathLike[str] | None, rank: int = 0, *, every: int = 10, writer: Any = None
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}.")
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}.")
        self.rank, self.every = rank, every
        self.path = None if log_dir is None else run_dir(log_dir, rank)
        if writer is None and self.path is not None:
            writer = _summary_writer(self.path)
        self.broken = False
        self.writer = None if writer is None else _Background(writer, self)
        self._last_point: int | None = None  # step of the previous point
        self._last_step: int | None = None
        self._last_time: float | None = None
        self._losses: list[float] = []
        self._seconds: list[float] = []
        self._staleness_seen: Counter[int] = Counter()
        self._source: Any = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TrainingLog:
        """The log ``ps-launch --tensorboard DIR train.py`` asks for: ``PS_TENSORBOARD`` (DIR; unset or
        empty: a log that records nothing), ``PS_TENSORBOARD_EVERY`` (default 10) and the rank of
        ``PS_RANK`` (or torchrun's ``RANK``; default 0).

        Raises:
            TensorBoardMissing: ``PS_TENSORBOARD`` is set and the package is not installed.
            ps_worker.env.EnvError: an invalid ``PS_RANK`` or ``PS_TENSORBOARD_EVERY``.
        """
        from ps_worker import env

        environ = os.environ if environ is None else environ
        log_dir, every = env.tensorboard_settings(environ)
        found = env.rank_and_workers(environ)
        return cls(log_dir or None, found[0] if found else 0, every=every)

    @property
    def enabled(self) -> bool:
        """Whether anything is written."""
        return self.writer is not None

    def log_step(self, source: Any = None, *, loss: Any = None, step: int, step_seconds: float | None = None) -> None:
        """Record one finished step; write a point at the first step and at each multiple of ``every``.

        Args:
            source: a :class:`~ps_worker.DistributedOptimizer` (learning rate, and its client's
                bytes and staleness), a :class:`~ps_worker.PSClient` (bytes and staleness), any
                torch optimizer (learning rate), or None.
            loss: the step's training loss (a float or a one-element tensor; ``.item()`` is called
                on a tensor, which waits for CUDA); None: no loss.
            step: the rank's step count after this step (``client.clock``, or the loop's counter).
            step_seconds: the step's seconds when the caller timed it; None: the wall time since
                the previous call (the first call's is unknown and left out).
        """
        if self.broken:
            self.writer = None  # its thread said why, once
        if self.writer is None:
            return
        now = time.perf_counter()
        if step_seconds is None and self._last_time is not None and self._last_step is not None:
            step_seconds = (now - self._last_time) / max(1, step - self._last_step)
        self._last_time, self._last_step, self._source = now, step, source
        if loss is not None:
            self._losses.append(float(loss.item() if hasattr(loss, "item") else loss))
        if step_seconds is not None:
            self._seconds.append(step_seconds)
        if self._last_point is None or step // self.every != self._last_point // self.every:
            self._guarded(self._write_point, step)

    def log_eval(self, scores: Mapping[str, float | None], step: int) -> None:
        """Write held-out scores as ``eval/NAME`` at ``step`` (None and non-finite values are left out).

        Args:
            scores: name -> value, e.g. a workload's ``{"accuracy": 0.97, "loss": 0.11}``.
            step: the rank's step the model was evaluated at.
        """
        if self.writer is None:
            return
        for name, value in sorted(scores.items()):
            if value is not None and math.isfinite(float(value)) and self.writer is not None:
                self._guarded(self.writer.add_scalar, f"eval/{name}", float(value), step)

    def close(self) -> None:
        """Write the steps since the last point, flush, and close the writer (idempotent)."""
        if self.writer is None:
            return
        if self._last_step is not None and self._last_step != self._last_point:
            self._guarded(self._write_point, self._last_step)
        writer, self.writer = self.writer, None
        if isinstance(writer, _Background) and not writer.close(CLOSE_SECONDS) and not self.broken:
            log.warning(
                "TensorBoard: rank %d's last curves did not reach %s within %.0f s; left behind", self.rank, self.path,
                CLOSE_SECONDS,
            )  # fmt: skip

    def _guarded(self, write: Any, *args: Any) -> None:
        """``write(*args)``; a failure turns the log off with one WARNING instead of reaching the step."""
        try:
            write(*args)
        except Exception as exc:  # a source's attribute gone, a bad value: best effort
            self.failed(exc)

    def failed(self, exc: BaseException) -> None:
        """Turn the log off after ``exc`` (from the step's thread or the writer's), saying so once."""
        if self.broken:
            return
        self.broken = True
        log.warning(
            "TensorBoard: writing rank %d's curves to %s failed (%s: %s); no more curves from this rank, and "
            "training goes on",
            self.rank,
            self.path,
            type(exc).__name__,
            exc,
        )

    def stalled(self) -> None:
        log.warning(
            "TensorBoard: rank %d's curves wait for %s (%d scalars queued): points are dropped until it catches "
            "up, and training goes on",
            self.rank,
            self.path,
            QUEUE_SCALARS,
        )

    def __enter__(self) -> TrainingLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_point(self, step: int) -> None:
        add = self.writer.add_scalar
        if self._losses:
            add("train/loss", sum(self._losses) / len(self._losses), step)
        if self._seconds:
            add("train/step_seconds", sum(self._seconds) / len(self._seconds), step)
        self._losses, self._seconds = [], []
        self._last_point = step
        source = self._source
        client = getattr(source, "client", None) if hasattr(source, "param_groups") else source
        if hasattr(source, "param_groups"):
            local = client is None or client.worker_mode.local_optimizer
            tag = "train/lr_local" if local else "train/lr_pushed"
            for g, group in enumerate(source.param_groups):
                if "lr" in group:
                    add(tag if g == 0 else f"{tag}/group{g}", float(group["lr"]), step)
        if client is not None and hasattr(client, "pushed_bytes"):
            add("comm/pushed_bytes", client.pushed_bytes, step)
            add("comm/pulled_bytes", client.pulled_bytes, step)
            counts = Counter(client.staleness)
            new = counts - self._staleness_seen  # the pushes counted since the previous point
            self._staleness_seen = counts
            if new:
                add("train/staleness", sum(v * n for v, n in new.items()) / sum(new.values()), step)
                add("train/staleness_max", max(new), step)


class _Background:
    """A writer's calls (``add_scalar``, ``flush``, ``close``) on a thread of their own, behind a queue
    of :data:`QUEUE_SCALARS`: a full queue drops the call (``log.stalled`` says so once); a
    failing call turns ``log`` off (``log.failed``), closes the writer and drops the rest."""

    def __init__(self, writer: Any, owner: TrainingLog) -> None:
        self.writer, self.owner = writer, owner
        self._queue: queue.Queue[tuple[str, tuple[Any, ...]]] = queue.Queue(maxsize=QUEUE_SCALARS)
        self._said_stalled = False
        self._thread = threading.Thread(target=self._run, name=f"tensorboard-rank-{owner.rank}", daemon=True)
        self._thread.start()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._put("add_scalar", (tag, value, step))

    def flush(self) -> None:
        self._put("flush", ())

    def close(self, within: float) -> bool:
        """Queue the writer's close and wait up to ``within`` seconds; whether it was done in time."""
        try:
            self._queue.put(("close", ()), timeout=within)
        except queue.Full:
            return False
        self._thread.join(within)
        return not self._thread.is_alive()

    def _put(self, name: str, args: tuple[Any, ...]) -> None:
        try:
            self._queue.put_nowait((name, args))
        except queue.Full:
            if not self._said_stalled and not self.owner.broken:
                self._said_stalled = True
                self.owner.stalled()

    def _run(self) -> None:
        broken = False
        while True:
            name, args = self._queue.get()
            if not broken:
                try:
                    getattr(self.writer, name)(*args)
                except Exception as exc:  # tensorboard's OSError of a gone directory, a full disk...
                    broken = True
                    self.owner.failed(exc)
                    try:
                        self.writer.close()
                    except Exception:  # noqa: S110 - the same failure again; said once above
                        pass
            if name == "close":
                return


def _summary_writer(path: Path) -> Any:
    require()
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # tensorboard present but unusable (too old, a missing dependency)
        raise TensorBoardMissing(f"torch.utils.tensorboard cannot load tensorboard ({exc}): {INSTALL}") from exc
    _quiet_writer_threads()
    return SummaryWriter(log_dir=str(path), flush_secs=FLUSH_SECONDS)


def _quiet_writer_threads() -> None:
    """tensorboard's writer thread dies on a failed write and ``threading`` prints its traceback; the
    :class:`TrainingLog`'s WARNING says it instead (other threads' errors go to the hook as before)."""
    previous = threading.excepthook
    if getattr(previous, "quiet_tensorboard", False):
        return

    def hook(args: Any) -> None:
        if args.thread is None or not type(args.thread).__module__.startswith("tensorboard."):
            previous(args)

    hook.quiet_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook
