"""Checkpoint files of one shard: atomic, versioned, digest-checked, loaded with ``weights_only=True``.

A checkpoint of shard ``k`` at version ``v`` is the file ``shard-{k}-v{v:012d}.pt`` in the
checkpoint directory; what it holds (an envelope with a sha256 digest, format version 1) and how it
is validated is :mod:`ps_server.checkpoint.format` (``FORMAT``, ``FORMAT_VERSION`` and ``digest``
are re-exported here).

A save writes ``.shard-{k}-v{v:012d}.<random>.tmp`` in the same directory, fsyncs it, renames it
onto the final name and fsyncs the directory, so a kill at any instant leaves either the previous
set of checkpoints or the new one plus a temp file, which the next save (or the next store opened
on the directory) removes. Stores of one (directory, shard) in a process share a lock; across
processes, one process at a time writes the checkpoints of a shard index in a directory.

Pruning never removes a checkpoint this store wrote unless ``keep`` newer ones are on disk: a save
removes only the files of higher versions that an earlier run left behind (an abandoned timeline)
and then all but the newest ``keep`` of the rest.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ps_common.errors import CheckpointError
from ps_server.checkpoint import format as checkpoint_format
from ps_server.checkpoint.failures import failure_message, failure_reason, os_error_in
from ps_server.checkpoint.format import FORMAT, FORMAT_VERSION, digest

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "CheckpointInfo",
    "CheckpointStore",
    "digest",
    "failure_reason",
    "os_error_in",
]

log = logging.getLogger(__name__)

_FINAL = re.compile(r"shard-(\d+)-v(\d+)\.pt")
_TEMP = re.compile(r"\.shard-(\d+)-.*\.tmp")

_locks: dict[tuple[Path, int], threading.RLock] = {}
_locks_guard = threading.Lock()


def _lock_for(directory: Path, shard_index: int) -> threading.RLock:
    """One lock per (directory, shard) in this process, shared by every store opened on them, so a
    second store cannot remove the temp file of a save in progress."""
    with _locks_guard:
        return _locks.setdefault((directory.resolve(), shard_index), threading.RLock())


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint file of a shard, as seen in the directory (its content is not checked).

    Attributes:
        version: the version in the file name.
        path: the file.
        size_bytes: its size in bytes.
    """

    version: int
    path: Path
    size_bytes: int


class CheckpointStore:
    """The checkpoints of shard ``shard_index`` in ``directory``; thread-safe.

    Opening a store on an existing directory removes this shard's temp files left by a writer that
    was killed mid-save (best effort: a read-only directory is logged, not raised). Files of other
    shard indices in the same directory are never touched.

    Args:
        directory: where the checkpoints live; created by the first save.
        shard_index: the shard whose files this store reads and writes (>= 0).
        keep: how many complete checkpoints to keep after each save (>= 1).

    Raises:
        ValueError: ``shard_index`` < 0 or ``keep`` < 1.
    """

    def __init__(self, directory: Path | str, shard_index: int, keep: int = 3) -> None:
        if isinstance(shard_index, bool) or not isinstance(shard_index, int) or shard_index < 0:
            raise ValueError(f"Checkpoint shard_index must be an int >= 0, got {shard_index!r}.")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Checkpoints to keep must be an int >= 1, got {keep!r}.")
        self.directory = Path(directory)
        self.shard_index = shard_index
        self.keep = keep
        self._lock = _lock_for(self.directory, shard_index)
        self._mine: set[int] = set()  # versions this store wrote and has not pruned: this run's timeline
        if self.directory.is_dir():
            with self._lock:
                try:
                    self._remove_temp_files()
                except OSError as exc:
                    log.warning("Could not remove leftover checkpoint temp files in %s: %s", self.directory, exc)

    def __repr__(self) -> str:
        return f"CheckpointStore({str(self.directory)!r}, shard_index={self.shard_index}, keep={self.keep})"

    def path_for(self, version: int) -> Path:
        """The file of this shard's checkpoint at ``version`` (which may not exist)."""
        return self.directory / f"shard-{self.shard_index}-v{version:012d}.pt"

    def checkpoints(self) -> list[CheckpointInfo]:
        """This shard's checkpoint files, oldest version first, by file name; contents are not read.

        Temp files, other shards' files and names not written by this module are left out.
        Returns an empty list when the directory does not exist. The listing is consistent with the
        saves of every store of this process on the same shard: a save is seen either before it
        started or after it pruned, never between.

        Raises:
            CheckpointError: the directory cannot be listed.
        """
        with self._lock:
            return self._checkpoints()

    def _checkpoints(self) -> list[CheckpointInfo]:
        found = []
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CheckpointError(f"Cannot list checkpoint directory {self.directory}: {exc.strerror}.") from exc
        for entry in entries:
            m = _FINAL.fullmatch(entry.name)
            if not m or int(m[1]) != self.shard_index or entry.name != self.path_for(int(m[2])).name:
                continue
            try:
                size = entry.stat().st_size
            except FileNotFoundError:  # removed meanwhile by another process
                continue
            found.append(CheckpointInfo(int(m[2]), Path(entry.path), size))
        return sorted(found, key=lambda c: c.version)

    def latest_version(self) -> int | None:
        """The newest version on disk by file name (not validated: see :meth:`load_latest`); None if none."""
        found = self.checkpoints()
        return found[-1].version if found else None

    def save(self, state: Mapping[str, Any], version: int) -> Path:
        """Write ``state`` as this shard's checkpoint at ``version``, atomically, then prune.

        Serializes synchronously: tensors in ``state`` must not change during the call (a caller
        that keeps training snapshots them first; a racing change makes the file fail its digest,
        never load wrong). A tensor view saves its whole storage, so pass standalone tensors.
        After the rename, checkpoints with a higher version than ``version`` that this store did
        not write are removed with a warning (they belong to a timeline this shard abandoned when it
        resumed from an older one, and must never be loaded as the newest), then all but the newest
        ``keep`` of the rest. A checkpoint this store wrote is never removed while fewer than
        ``keep`` newer ones are on disk; callers save in version order (a save older than ``keep``
        checkpoints this store wrote is pruned at once).

        Args:
            state: the payload (see the module docstring for the types allowed); tensors may be
                on any device and load on the CPU.
            version: the shard's version (>= 0); names the file.

        Returns:
            The path of the complete checkpoint.

        Raises:
            TypeError: ``state`` holds a value ``torch.load(weights_only=True)`` cannot load.
            ValueError: ``version`` is not an int >= 0.
            CheckpointError: the directory cannot be created or written, or the disk is full;
                no partial file is left behind.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"Checkpoint version must be an int >= 0, got {version!r}.")
        if not isinstance(state, Mapping):
            raise TypeError(f"Checkpoint state must be a dict, got {type(state).__name__}.")
        envelope = checkpoint_format.envelope(dict(state), self.shard_index, version)
        final = self.path_for(version)
        with self._lock:
            self._write(envelope, final)
            self._prune(version)
        log.info("Checkpoint of shard %d at version %d written to %s", self.shard_index, version, final)
        return final

    def load(self, version: int) -> dict[str, Any]:
        """The state saved at ``version``, validated (see :meth:`load_latest`).

        Raises:
            CheckpointError: there is no such checkpoint, or it does not load or fails validation.
        """
        path = self.path_for(version)
        with self._lock:
            if not path.exists():
                have = ", ".join(str(c.version) for c in self.checkpoints()) or "none"
                raise CheckpointError(
                    f"Shard {self.shard_index} has no checkpoint at version {version} in {self.directory} "
                    f"(versions there: {have})."
                )
            state, problem = checkpoint_format.read(path, self.shard_index, version)
        if problem:
            raise CheckpointError(f"Checkpoint {path} {problem}.")
        return state

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        """The newest valid checkpoint of this shard, as ``(version, state)``.

        A file is valid when ``torch.load(path, weights_only=True, map_location="cpu")`` returns an
        envelope of this format whose shard index is this store's, whose version equals the file
        name's and whose sha256 digest matches its content. An invalid file is logged at WARNING
        (naming it and why) and the next older one is tried. Tensors come back on the CPU.

        Returns:
            ``(version, state)``, or None when this shard has no checkpoint in the directory.

        Raises:
            CheckpointError: checkpoints exist but none is valid (the shard should not silently
                start over: move the files away to start from scratch), or the directory cannot be listed.
        """
        with self._lock:
            found = self.checkpoints()
            for info in reversed(found):
                state, problem = checkpoint_format.read(info.path, self.shard_index, info.version)
                if not problem:
                    log.info(
                        "Loaded checkpoint of shard %d at version %d from %s", self.shard_index, info.version, info.path
                    )
                    return info.version, state
                log.warning("Skipping checkpoint %s: it %s; trying the previous one.", info.path, problem)
        if found:
            raise CheckpointError(
                f"None of the {len(found)} checkpoints of shard {self.shard_index} in {self.directory} is valid "
                "(see the warnings above); move them away to start this shard from scratch."
            )
        return None

    def ensure_writable(self) -> None:
        """Create the directory if needed and check that a file can be written there (for a shard
        to refuse to start rather than fail at its first checkpoint).

        Raises:
            CheckpointError: the directory cannot be created or written.
        """
        with self._lock:
            self._mkdir()
            try:
                fd, name = tempfile.mkstemp(
                    dir=self.directory, prefix=f".shard-{self.shard_index}-probe.", suffix=".tmp"
                )
                os.close(fd)
                os.unlink(name)
            except OSError as exc:
                raise CheckpointError(self._write_failure("write a file in", exc)) from exc

    # -- internals -------------------------------------------------------------------------------

    def _mkdir(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(self._write_failure("create", exc)) from exc

    def _write_failure(self, what: str, exc: BaseException) -> str:
        return failure_message(self.directory, what, exc)

    def _write(self, envelope: dict[str, Any], final: Path) -> None:
        self._mkdir()
        try:
            self._remove_temp_files()
            self._make_room(envelope["version"])
            fd, name = tempfile.mkstemp(dir=self.directory, prefix=f".{final.name}.", suffix=".tmp")
        except OSError as exc:
            raise CheckpointError(self._write_failure(f"write {final.name} in", exc)) from exc
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(envelope, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, Exception):
                raise CheckpointError(self._write_failure(f"write {final.name} in", exc)) from exc
            raise
        self._fsync_directory()

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # file systems that cannot sync directories
                raise CheckpointError(f"Cannot sync checkpoint directory {self.directory}: {exc.strerror}.") from exc
        finally:
            os.close(fd)

    def _remove_temp_files(self) -> None:
        for entry in os.scandir(self.directory):
            m = _TEMP.fullmatch(entry.name)
            if m and int(m[1]) == self.shard_index:
                Path(entry.path).unlink(missing_ok=True)
                log.info("Removed %s, left by a checkpoint write that did not finish", entry.path)

    def _prune(self, written: int) -> None:
        """Remove higher versions left by an earlier run, then all but the newest ``keep`` of the
        rest (caller holds the lock, ``written`` was just renamed into place)."""
        self._mine.add(written)
        found = self._checkpoints()
        abandoned = [c for c in found if c.version > written and c.version not in self._mine]
        timeline = [c for c in found if c.version <= written or c.version in self._mine]
        for c in abandoned:
            log.warning(
                "Removing checkpoint %s: version %d was just written, so version %d belongs to an abandoned run.",
                c.path,
                written,
                c.version,
            )
        self._remove(abandoned + timeline[: max(0, len(timeline) - self.keep)])

    def _make_room(self, version: int) -> None:
        """Before writing ``version``, remove the checkpoints its prune would remove anyway (those
        with ``keep`` newer ones below ``version``), so that a kill between a rename and its prune
        leaves at most ``keep + 1``, however many writers in a row were killed there."""
        timeline = [c for c in self._checkpoints() if c.version < version or c.version in self._mine]
        self._remove(timeline[: max(0, len(timeline) - self.keep)])

    def _remove(self, doomed: list[CheckpointInfo]) -> None:
        self._mine.difference_update(c.version for c in doomed)
        for c in doomed:
            try:
                c.path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("Could not remove old checkpoint %s: %s", c.path, exc.strerror)
            else:
                log.debug("Removed old checkpoint %s", c.path)
