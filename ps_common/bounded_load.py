"""Files a process loads at start (a model file for ``--init-from``, a shard's checkpoint) checked
for what they declare before anything is inflated (docs/faults.md, "checkpoints").

``torch.save`` writes a zip archive whose entries are stored, not compressed: a file's entries
declare as many bytes as the file holds. A crafted archive may deflate its entries instead, so that
a few megabytes declare gigabytes (a 4.2 MB ``.pt`` inflated to 4.3 GB on every rank before any
check). :func:`check_zip` reads the archive's directory (no entry is read) and refuses one that
declares more than :func:`inflated_bound` of the file's size and of what the loader expects.
safetensors files hold their tensors raw: :func:`safetensors_header` reads the header alone, so a
caller checks the declared keys, dtypes and shapes before loading. :func:`torch_load` loads a file
that passed, and keeps torch's warnings about a file that does not load out of the one line that
refuses it.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
import zipfile
from typing import Any

SLACK_BYTES = 1 << 20
"""Bytes beyond the bound a file may declare (the archive's own records, small pickles)."""

MAX_HEADER_BYTES = 100 << 20
"""Largest safetensors header read (as the safetensors package's own limit)."""


def inflated_bound(file_bytes: int, expected_bytes: int = 0) -> int:
    """Most bytes a file of ``file_bytes`` may declare: twice its size or twice what the loader
    expects (a model's tensors), whichever is larger, plus :data:`SLACK_BYTES`."""
    return 2 * max(file_bytes, expected_bytes) + SLACK_BYTES


def check_zip(path: str | os.PathLike[str], expected_bytes: int = 0) -> str | None:
    """Why the ``torch.save`` archive ``path`` must not be loaded, or None (also for a file that is
    not a zip archive: ``torch.load`` then says what it is).

    Args:
        path: the file. expected_bytes: bytes of tensors the caller expects (0: unknown).

    Returns:
        A phrase that follows the file's name, e.g. "declares 4.3 GB uncompressed in 4.2 MB ...".

    Raises:
        OSError: the file cannot be read.
    """
    size = os.path.getsize(path)
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError):
        return None  # not an archive (or a legacy torch.save): read as it is, its bytes bound it
    declared = sum(e.file_size for e in entries)
    bound = inflated_bound(size, expected_bytes)
    if declared > bound:
        return (
            f"declares {_size(declared)} uncompressed in {_size(size)} (more than {_size(bound)}, twice the file "
            "or the model; torch.save writes its entries uncompressed): refused before loading"
        )
    return None


def torch_load(path: str | os.PathLike[str]) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``, its warnings issued only when the
    file loads: one that does not (random bytes, a crafted pickle) makes torch warn first (its pickle
    protocol, say) and then raise, and the caller refuses it in one line that says why.

    Raises:
        What ``torch.load`` raises (the caller words it).
    """
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = torch.load(path, map_location="cpu", weights_only=True)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return state


def safetensors_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The header of safetensors file ``path``: key -> ``{"dtype", "shape", "data_offsets"}``
    (``__metadata__`` left out), read without reading any tensor.

    Raises:
        ValueError: not a safetensors file (a phrase that follows the file's name).
        OSError: the file cannot be read.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("is too short for a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"declares a header of {length} bytes in a file of {size}: not a safetensors file")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("has no JSON header: not a safetensors file") from None
    if not isinstance(header, dict):
        raise ValueError("has no JSON header: not a safetensors file")
    header.pop("__metadata__", None)
    for key, info in header.items():
        ok = isinstance(info, dict) and isinstance(info.get("dtype"), str) and isinstance(info.get("shape"), list)
        if not ok or not all(isinstance(d, int) and d >= 0 for d in info["shape"]):
            raise ValueError(f"declares tensor {key[:80]!r} without a dtype and a shape")
    return header


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
