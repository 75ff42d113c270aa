"""The model file ``ps-admin export`` and ``ps-launch --save`` write: its format, its table tensors,
and the atomic write (docs/operations.md#export-the-model-in-one-file).

A model file is a flat ``{key: tensor}`` mapping that torch (``torch.load(weights_only=True)``) or
safetensors (``safetensors.torch.load_file``) reads without grpc-ps installed:

- every dense plan key (``fc1.weight``...) at its shape and dtype;
- every embedding table under its name (the model's key, ``emb.weight``) as the full float32 matrix
  ``[num_rows, dim]``: the rows the shards hold, and every other row at its initial value
  (``ps_common.tables.initial_rows`` of the table's name, seed and init_std: what a pull would read);
- a table whose matrix would exceed :data:`DENSE_TABLE_BYTES` (hashed ids over a huge id space) as
  ``<name>.ids`` (int64 ``[n]``, ascending) and ``<name>.rows`` (float32 ``[n, dim]``): only the rows
  the shards hold; any other id reads as its initial value.

torch, numpy and safetensors are imported inside the functions only: ``ps-admin`` stays torch-free at
import.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

FORMATS = {".safetensors": "safetensors", ".pt": "pt", ".pth": "pt"}
"""Suffix -> format of a model file (``--format`` overrides the suffix)."""

DENSE_TABLE_BYTES = 2 * 1024**3
"""Largest table written as a full ``[num_rows, dim]`` matrix (2 GiB of float32); a larger one is
written as ``<name>.ids`` and ``<name>.rows`` (the rows the shards hold)."""

INIT_CHUNK_ELEMENTS = 1 << 22
"""Elements of initial rows computed at once (bounds the generator's float64 scratch to ~100 MiB)."""

SAFETENSORS_MISSING = (
    "Writing .safetensors needs the safetensors package: pip install 'grpc-ps[safetensors]' "
    "(or pip install safetensors); or write a .pt file (--format pt)."
)


class ModelFileError(ValueError):
    """A model file that cannot be written as asked (unknown format, missing package, bad path)."""


def format_of(path: str, fmt: str | None = None) -> str:
    """The format of model file ``path``: ``fmt`` when given, else its suffix's.

    Returns:
        "safetensors" or "pt".

    Raises:
        ModelFileError: an unknown ``fmt``, or no ``fmt`` and a suffix other than .safetensors, .pt, .pth.
    """
    if fmt:
        if fmt not in set(FORMATS.values()):
            raise ModelFileError(f"Unknown model format {fmt!r}; expected safetensors or pt.")
        return fmt
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMATS:
        raise ModelFileError(
            f"Cannot tell the format of {path!r} from its suffix {suffix or '(none)'!r}; name it .safetensors or "
            ".pt, or pass --format safetensors|pt."
        )
    return FORMATS[suffix]


def check_target(path: str, fmt: str) -> None:
    """Refuse, before any work, a model file that cannot be written: its directory missing or not
    writable, the path a directory, or safetensors asked for but not installed.

    Raises:
        ModelFileError: what is wrong, in a sentence.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ModelFileError(f"{path} is a directory; give the model file's path.")
    if not os.path.isdir(directory):
        raise ModelFileError(f"Cannot write {path}: directory {directory} does not exist.")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ModelFileError(f"Cannot write {path}: directory {directory} is not writable.")
    if fmt == "safetensors":
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise ModelFileError(SAFETENSORS_MISSING) from None


def default_format() -> str:
    """safetensors when installed, else pt (``ps-launch --save``'s default file name)."""
    try:
        import safetensors  # noqa: F401
    except ImportError:
        return "pt"
    return "safetensors"


def table_tensors(
    specs: Sequence[Any], rows: Mapping[str, list[tuple[bytes, bytes]]], dense_limit: int = DENSE_TABLE_BYTES
) -> dict[str, Any]:
    """Each table's tensors of the model file (see the module's docstring).

    Args:
        specs: the tables (``TableSpec`` messages: name, num_rows, dim, seed, init_std, initializer).
        rows: table name -> the (ids bytes, values bytes) blocks every shard sent (int64 and float32,
            little-endian); each id at most once over all blocks.
        dense_limit: bytes of the largest table written as a full matrix.

    Returns:
        ``{name: float32 [num_rows, dim]}`` or ``{name.ids: int64 [n], name.rows: float32 [n, dim]}``.

    Raises:
        ModelFileError: a block of the wrong size, an id out of range or sent twice.
    """
    import torch

    from ps_common.tables import initial_rows

    out: dict[str, Any] = {}
    for spec in specs:
        blocks = rows.get(spec.name, [])
        ids = torch.frombuffer(bytearray(b"".join(i for i, _ in blocks)) or bytearray(8), dtype=torch.int64)
        values = torch.frombuffer(bytearray(b"".join(v for _, v in blocks)) or bytearray(4), dtype=torch.float32)
        ids, values = (ids, values) if blocks else (ids[:0], values[:0])
        n = ids.numel()
        if values.numel() != n * spec.dim:
            raise ModelFileError(f"The shards sent {n} ids but {values.numel()} values of table {spec.name!r}.")
        values = values.view(n, spec.dim)
        if n and (int(ids.min()) < 0 or int(ids.max()) >= spec.num_rows or ids.unique().numel() != n):
            raise ModelFileError(f"The shards sent ids of table {spec.name!r} out of range or twice; export again.")
        if spec.num_rows * spec.dim * 4 > dense_limit:
            order = torch.sort(ids).indices
            out[f"{spec.name}.ids"], out[f"{spec.name}.rows"] = ids[order], values[order]
            continue
        weight = torch.empty(spec.num_rows, spec.dim, dtype=torch.float32)
        step = max(1, INIT_CHUNK_ELEMENTS // spec.dim)
        for start in range(0, spec.num_rows, step):
            chunk = torch.arange(start, min(start + step, spec.num_rows), dtype=torch.int64)
            uniform = (spec.init_low, spec.init_high) if getattr(spec, "initializer", "") == "uniform" else None
            initial = initial_rows(spec.name, spec.seed, spec.init_std, chunk, spec.dim, uniform)
            weight[start : start + chunk.numel()] = initial
        weight[ids] = values
        out[spec.name] = weight
    return out


def save(state: Mapping[str, Any], path: str, fmt: str) -> None:
    """Write ``state`` (``{key: tensor}``) to ``path`` in ``fmt`` ("safetensors" or "pt", a plain
    ``torch.save`` dict) atomically: a temp file in the same directory, fsynced, then renamed.

    Raises:
        ModelFileError: safetensors asked for but not installed.
        OSError: the file cannot be written (nothing is left behind).
    """
    import torch

    if fmt == "safetensors":
        try:
            from safetensors.torch import save as to_bytes
        except ImportError:
            raise ModelFileError(SAFETENSORS_MISSING) from None
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".ps-export-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            if fmt == "safetensors":
                f.write(to_bytes({k: v.contiguous() for k, v in state.items()}))
            else:
                torch.save(dict(state), f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would create it (mkstemp's is 0600)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
