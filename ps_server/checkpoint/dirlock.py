"""``DIR/shard-K.lock``: the lock a running shard holds on its checkpoint directory, so that an
offline tool (``ps-admin reshard``) can tell a stopped job from a live one
(docs/operations.md#reshard-restore-a-job-onto-another-shard-count).

A shard started with ``--checkpoint-dir DIR`` takes an exclusive ``flock`` on ``DIR/shard-K.lock``
before it resumes and holds it until it stops; the kernel releases it when the process ends, kill -9
included, so a crashed shard leaves no stale lock (the file stays, empty of meaning). The file holds
the holder's PID, for messages only. Stores of one (directory, shard) in one process share one lock
(a count of holders): in-process servers restarted on the same directory never wait on themselves.

``ps-admin reshard`` takes every shard's lock without waiting (:func:`take_all`) for as long as it
reads and rewrites the set, and refuses, naming the shard and its PID, while one is held.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from ps_common.errors import CheckpointError

log = logging.getLogger(__name__)

HOLD_WAIT_SECONDS = 10.0
"""How long a starting shard waits for its lock while another process holds it (a shard of the
same index still writing its final checkpoint); then it warns and runs without it."""

_LOCK_NAME = re.compile(r"shard-(\d+)\.lock")
_held: dict[tuple[Path, int], list[int]] = {}  # (directory, shard) -> [fd, holders in this process]
_guard = threading.Lock()


def lock_path(directory: Path | str, shard_index: int) -> Path:
    """The lock file of shard ``shard_index`` in ``directory``."""
    return Path(directory) / f"shard-{shard_index}.lock"


class ShardLock:
    """One holder's share of a shard's lock; :meth:`release` once (later calls do nothing)."""

    def __init__(self, key: tuple[Path, int]) -> None:
        self._key: tuple[Path, int] | None = key

    def release(self) -> None:
        with _guard:
            key, self._key = self._key, None
            entry = _held.get(key) if key is not None else None
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del _held[key]
                os.close(entry[0])  # releases the flock


def hold(directory: Path | str, shard_index: int, wait: float = HOLD_WAIT_SECONDS) -> ShardLock | None:
    """Take shard ``shard_index``'s lock on ``directory`` (which exists) for a running shard.

    Returns:
        The lock (release it when the shard stops), or None when another process still held it
        after ``wait`` seconds, or the file system has no ``flock`` (logged at WARNING; the shard
        runs without it, as before locks).

    Raises:
        CheckpointError: the lock file cannot be created.
    """
    key = (Path(directory).resolve(), shard_index)
    path = lock_path(directory, shard_index)
    with _guard:
        if key in _held:
            _held[key][1] += 1
            return ShardLock(key)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise CheckpointError(f"Cannot create the lock file {path}: {exc.strerror}.") from exc
        deadline = time.monotonic() + wait
        while not (locked := _try_lock(fd, path)):
            if locked is None or time.monotonic() >= deadline:
                os.close(fd)
                if locked is None:
                    return None
                log.warning(
                    "%s is held by %s: another shard %d runs on this checkpoint directory; running without the lock "
                    "(ps-admin reshard cannot see this shard).",
                    *(path, _holder(path), shard_index),
                )
                return None
            time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _held[key] = [fd, 1]
        return ShardLock(key)


@contextlib.contextmanager
def take_all(directory: Path, shard_indices: Iterable[int]) -> Iterator[None]:
    """Hold, without waiting, the lock of every shard in ``shard_indices`` and of every
    ``shard-K.lock`` file in ``directory`` (a directory that does not exist needs none).

    Raises:
        CheckpointError: a shard holds its lock (a shard of this process, or process PID), naming it.
    """
    indices = set(shard_indices)
    with contextlib.suppress(OSError):
        indices.update(int(m[1]) for e in os.scandir(directory) if (m := _LOCK_NAME.fullmatch(e.name)))
    if not directory.is_dir():
        yield
        return
    taken: list[int] = []
    try:
        for k in sorted(indices):
            path = lock_path(directory, k)
            with _guard:
                mine = (directory.resolve(), k) in _held
            if mine:
                raise CheckpointError(_live(path, k, "a shard of this process"))
            fd = _open(path)
            if fd is None:  # no lock file and none can be made (a read-only --from): no shard holds it
                continue
            taken.append(fd)
            if _try_lock(fd, path) is False:  # None: no flock on this file system, nothing to tell
                raise CheckpointError(_live(path, k, _holder(path)))
        yield
    finally:
        for fd in taken:
            os.close(fd)


def _live(path: Path, shard_index: int, holder: str) -> str:
    return (
        f"Shard {shard_index} is running on {path.parent} ({path.name} is held by {holder}): stop every shard of "
        "the job first (its final checkpoints are what a reshard restores), then reshard."
    )


def _open(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        pass
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # flock needs no write access
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"Cannot open the lock file {path}: {exc.strerror}.") from exc


def _try_lock(fd: int, path: Path) -> bool | None:
    """True: locked; False: another holds it; None: the file system has no flock (ENOLCK, EINVAL)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        log.warning("Cannot lock %s (%s): the shard locks are not used on this file system.", path, exc.strerror)
        return None
    return True


def _holder(path: Path) -> str:
    try:
        pid = path.read_text().strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "another process"
