"""``python -m ps_server.checkpoint.reshard_cli --from DIR --to N [--out DIR2] [--version V]`` (what
``ps-admin reshard`` runs): restore a stopped job's checkpoints onto another shard count, offline
(docs/operations.md#reshard-restore-a-job-onto-another-shard-count).

Reads the newest version at which every shard of the checkpoint set in DIR has a file (or
``--version``), validates every file (format, digest, plan), reshards the states
(:func:`ps_server.checkpoint.reshard.reshard_states`) and writes N files ``shard-{k}-v{v:012d}.pt``
in the normal format (:class:`~ps_server.checkpoint.files.CheckpointStore`). With ``--out`` they go
to DIR2, which must hold no checkpoint; without it they replace the set in DIR: they are written to
a staging folder first, then every old checkpoint file of DIR moves into
``DIR/before-reshard-v{v}-{S}-shards/`` (kept for a rollback), then the new files move in. In
place, every shard's lock (``DIR/shard-K.lock``, :mod:`ps_server.checkpoint.dirlock`) is taken
without waiting and held throughout: a running shard of the job is a refusal. Every tensor is
checked against the plan (:mod:`ps_server.checkpoint.checks`) and ``--to`` is bounded
(:data:`~ps_server.checkpoint.reshard.MAX_SHARDS`, and the job's elements and rows) before any
planning. Any refusal happens before anything is written, in one line. Exit status: 0 done, 1
refused, 2 bad flags.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ps_common.errors import CheckpointError
from ps_server.checkpoint import format as checkpoint_format
from ps_server.checkpoint.checks import check_layout
from ps_server.checkpoint.dirlock import take_all
from ps_server.checkpoint.files import CheckpointStore
from ps_server.checkpoint.reshard import MAX_SHARDS, ReshardError, reshard_states
from ps_server.tables.table import table_row_bytes
from ps_server.tables.table_io import spec_from_export

log = logging.getLogger(__name__)

_FINAL = re.compile(r"shard-(\d+)-v(\d+)\.pt")


def checkpoint_files(directory: Path) -> dict[int, dict[int, Path]]:
    """version -> shard index -> file, for every checkpoint file name in ``directory``.

    Raises:
        ReshardError: the directory does not exist or cannot be listed.
    """
    try:
        entries = list(os.scandir(directory))
    except OSError as exc:
        raise ReshardError(f"Cannot list checkpoint directory {directory}: {exc.strerror}.") from exc
    found: dict[int, dict[int, Path]] = {}
    for entry in entries:
        m = _FINAL.fullmatch(entry.name)
        if m and entry.is_file():
            found.setdefault(int(m[2]), {})[int(m[1])] = Path(entry.path)
    return found


def read_set(directory: Path, version: int | None = None) -> tuple[int, list[dict[str, Any]]]:
    """The newest complete checkpoint set in ``directory`` (or the one at ``version``): every shard
    of the job (the count shard 0's plan names) has a valid file at that version.

    Returns:
        (version, the state of each shard in shard order).

    Raises:
        ReshardError: no checkpoint, no version every shard has, or a file of the set that does not
            load or fails its digest (named, with why).
    """
    found = checkpoint_files(directory)
    if not found:
        raise ReshardError(f"No checkpoint files (shard-K-vV.pt) in {directory}.")
    if version is not None and version not in found:
        raise ReshardError(f"No checkpoint at version {version} in {directory} (versions there: {sorted(found)}).")
    candidates = [version] if version is not None else sorted(found, reverse=True)
    for v in candidates:
        files = found[v]
        if 0 not in files:
            continue
        head = _read(files[0], 0, v)
        count = _shard_count(head, files[0])
        if any(k not in files for k in range(count)):
            continue
        newer = {u: sorted(found[u]) for u in found if u > v}
        if newer:
            log.warning(
                "Resharding version %d, the newest every shard has; newer versions with only some shards' files are "
                "set aside (%s): shards that ran past the others (async or ssp), or a set cut short.",
                *(v, "; ".join(f"v{u}: shards {ks}" for u, ks in sorted(newer.items()))),
            )
        return v, [head, *(_read(files[k], k, v) for k in range(1, count))]
    by_shard: dict[int, list[int]] = {}
    for v, files in sorted(found.items()):
        for k in files:
            by_shard.setdefault(k, []).append(v)
    have = "; ".join(f"shard {k}: {vs}" for k, vs in sorted(by_shard.items()))
    raise ReshardError(
        f"No version{'' if version is None else f' {version}'} in {directory} has a checkpoint of every shard "
        f"({have}). Shards of an async or ssp job checkpoint their own versions: stop the job so that every "
        "shard writes its final checkpoint at the same version (its workers finished), then reshard."
    )


def _shard_count(head: dict[str, Any], path: Path) -> int:
    """The shard count shard 0's checkpoint names (its layout checked first)."""
    try:
        check_layout(head, 0)
    except CheckpointError as exc:
        raise ReshardError(f"Checkpoint {path}: {exc} Nothing was written.") from None
    count = head["plan"]["num_shards"]
    if not 1 <= count <= MAX_SHARDS:
        raise ReshardError(f"Checkpoint {path} names {count} shards; a plan holds 1 to {MAX_SHARDS}.")
    return count


def _read(path: Path, shard_index: int, version: int) -> dict[str, Any]:
    state, problem = checkpoint_format.read(path, shard_index, version)
    if problem:
        raise ReshardError(f"Checkpoint {path} {problem}; nothing was written.")
    return state


def table_sizes(states: Sequence[dict[str, Any]]) -> str:
    """What each new shard must be allowed to hold of the tables (its ``--max-table-rows`` and
    ``--max-table-bytes``: a shard refuses to start from a checkpoint beyond them); '' without tables."""
    rows, held = 0, 0
    for state in states:
        saved = (state.get("tables") or {}).get("tables", [])
        rows = max([rows, *(int(t["ids"].numel()) for t in saved)])
        held = max(held, sum(int(t["ids"].numel()) * table_row_bytes(spec_from_export(t)) for t in saved))
    if not held:
        return ""
    return f"; each shard holds at most {rows} rows of a table and {held} bytes of tables"


def reshard_directory(source: Path, num_shards: int, out: Path | None = None, version: int | None = None) -> str:
    """Reshard the checkpoint set in ``source`` onto ``num_shards`` shards, into ``out`` (None: in
    place, the old files kept in a ``before-reshard-…`` folder of ``source``).

    Returns:
        One line saying what was done.

    Raises:
        ReshardError: bad input (see :func:`read_set` and :func:`reshard_states`), ``out`` holds
            checkpoints already, or a shard holds its lock on ``source`` (in place) or ``out``;
            nothing was written.
        CheckpointError: a file could not be written (the old set is untouched, or moved whole).
    """
    if isinstance(num_shards, int) and num_shards > MAX_SHARDS:
        raise ReshardError(f"Cannot reshard onto {num_shards} shards: a plan holds at most {MAX_SHARDS}.")
    in_place = out is None or out.resolve() == source.resolve()
    shards = {k for files in checkpoint_files(source).values() for k in files} if in_place else set()
    try:  # in place, the set is rewritten: no shard may run on it (ps_server.checkpoint.dirlock)
        with take_all(source, shards) if in_place else contextlib.nullcontext():
            with take_all(out, range(num_shards)) if out is not None and not in_place else contextlib.nullcontext():
                return _reshard(source, num_shards, out, version)
    except ReshardError:
        raise
    except CheckpointError as exc:
        raise ReshardError(f"{exc} Nothing was written.") from None


def _reshard(source: Path, num_shards: int, out: Path | None, version: int | None) -> str:
    v, states = read_set(source, version)
    old_count = len(states)
    if out is not None and out.resolve() != source.resolve() and out.is_dir() and checkpoint_files(out):
        raise ReshardError(f"{out} holds checkpoints already; give an empty --out (or none: reshard in place).")
    new_states = reshard_states(states, num_shards)
    if out is not None and out.resolve() != source.resolve():
        for k, state in enumerate(new_states):
            CheckpointStore(out, k, keep=1).save(state, v)
        return (
            f"resharded version {v} of {old_count} shards in {source} onto {num_shards} shards in {out}"
            + table_sizes(new_states)
        )
    backup = source / f"before-reshard-v{v}-{old_count}-shards"
    if backup.exists():
        raise ReshardError(f"{backup} exists already (an earlier reshard of this set): move it away first.")
    staging = source / f".reshard-staging-v{v}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for k, state in enumerate(new_states):
            CheckpointStore(staging, k, keep=1).save(state, v)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    backup.mkdir()
    for files in checkpoint_files(source).values():
        for path in files.values():
            os.replace(path, backup / path.name)
    for k in range(num_shards):
        name = f"shard-{k}-v{v:012d}.pt"
        os.replace(staging / name, source / name)
    shutil.rmtree(staging, ignore_errors=True)
    _fsync(source)
    return (
        f"resharded version {v} of {old_count} shards in {source} onto {num_shards} shards in place; "
        f"the {old_count}-shard files are in {backup}" + table_sizes(new_states)
    )


def _fsync(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def parser() -> argparse.ArgumentParser:
    """The flags of ``ps-admin reshard``."""
    p = argparse.ArgumentParser(
        prog="ps-admin reshard",
        description="Restore a stopped job's checkpoints onto another shard count (offline).",
    )
    p.add_argument("--from", dest="source", required=True, metavar="DIR", help="the job's checkpoint directory")
    p.add_argument("--to", dest="num_shards", required=True, type=int, metavar="N", help="the new shard count (>= 1)")
    p.add_argument(
        "--out", default=None, metavar="DIR2", help="write the N files here (empty) instead of replacing DIR's set"
    )
    p.add_argument("--version", type=int, default=None, help="reshard this version (default: the newest complete set)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ps-admin reshard``."""
    p = parser()
    args = p.parse_args(argv)
    if not 1 <= args.num_shards <= MAX_SHARDS:
        p.error(f"--to must be in 1..{MAX_SHARDS}, got {args.num_shards}.")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        line = reshard_directory(Path(args.source), args.num_shards, Path(args.out) if args.out else None, args.version)
    except CheckpointError as exc:
        print(f"ps-admin reshard: {exc}", file=sys.stderr)
        return 1
    print(f"ps-admin reshard: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
