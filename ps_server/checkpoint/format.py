"""The checkpoint file format (version 1): the envelope, its sha256 digest, and reading it back.

A checkpoint of shard ``k`` at version ``v`` is one file written by ``torch.save`` (a zip archive)
holding one dict, the envelope::

    {"format": "grpc-ps.checkpoint", "format_version": 1, "shard_index": k, "version": v,
     "sha256": "<64 hex digits>", "state": {...the caller's state...}}

``sha256`` is the digest of a canonical encoding of the other five fields: every value tagged with
its type, strings and containers length-prefixed, dict items in order, tensors as dtype, shape and
their raw bytes in row-major order. A reader recomputes it from what ``torch.load`` returned, so a
file whose bytes were torn, truncated, zeroed or flipped either fails to load or fails the digest;
only a file whose loaded content equals what was saved is valid. The state may hold only what
``torch.load(weights_only=True)`` accepts: tensors, dicts, lists, tuples, str, bytes, int, float,
bool, None, ``torch.Size`` and ``torch.dtype`` (no pickled classes; docs/architecture.md#8-security).

Where the files live, how they are written atomically and pruned: :mod:`ps_server.checkpoint.files`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from ps_common import bounded_load

FORMAT = "grpc-ps.checkpoint"
"""Value of the envelope's ``format`` field."""

FORMAT_VERSION = 1
"""Envelope layout this module writes and reads."""


def envelope(state: dict[str, Any], shard_index: int, version: int) -> dict[str, Any]:
    """The envelope of ``state`` for shard ``shard_index`` at ``version``, with its digest.

    Raises:
        TypeError: ``state`` holds a value a checkpoint may not hold (see :func:`digest`).
    """
    body = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "shard_index": shard_index,
        "version": version,
        "state": state,
    }
    return {**body, "sha256": digest(body)}


def read(path: Path, shard_index: int, version: int) -> tuple[dict[str, Any], str | None]:
    """Load and validate the file ``path``, expected to hold shard ``shard_index`` at ``version``.

    Refuses an archive that declares more than twice its size uncompressed (``torch.save`` stores
    its entries: a deflate bomb, :func:`ps_common.bounded_load.check_zip`) before loading; loads
    with ``torch.load(path, weights_only=True, map_location="cpu")`` (tensors come back on the CPU)
    and checks the format, its version, the shard index, the version and the digest.

    Returns:
        ``(state, None)`` for a valid file, else ``({}, why it is not valid)``: a phrase that follows
        "Checkpoint <path>", e.g. "fails its sha256 digest check (the file is corrupt)".

    Raises:
        MemoryError: the file is too big to load (every other failure to load is returned).
    """
    try:  # what the archive declares, before anything inflates (a deflate bomb: ps_common.bounded_load)
        problem = bounded_load.check_zip(path)
    except OSError as exc:
        return {}, f"cannot be read ({exc.strerror})"
    if problem:
        return {}, problem
    try:
        env = bounded_load.torch_load(path)
    except MemoryError:
        raise
    except Exception as exc:  # torn zip, bad pickle, disallowed global, I/O error: all mean unusable
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return {}, f"does not load with torch.load(weights_only=True) ({type(exc).__name__}: {detail[:160]})"
    if not isinstance(env, dict) or env.get("format") != FORMAT:
        return {}, f"is not a {FORMAT} file"
    if env.get("format_version") != FORMAT_VERSION:
        return {}, f"has format version {env.get('format_version')!r}; this grpc-ps reads {FORMAT_VERSION}"
    if env.get("shard_index") != shard_index:
        return {}, f"belongs to shard {env.get('shard_index')!r}, not shard {shard_index}"
    if env.get("version") != version:
        return {}, f"holds version {env.get('version')!r} but its file name says {version}"
    if not isinstance(env.get("state"), dict):
        return {}, "has no state dict"
    body = {k: env[k] for k in ("format", "format_version", "shard_index", "version", "state")}
    try:
        ok = digest(body) == env.get("sha256")
    except TypeError as exc:
        return {}, f"holds a value a checkpoint may not hold ({exc})"
    if not ok:
        return {}, "fails its sha256 digest check (the file is corrupt)"
    return env["state"], None


def digest(value: Any) -> str:
    """sha256 hex digest of a canonical encoding of ``value`` (see the module docstring).

    Equal for a value before ``torch.save`` and after ``torch.load``; tensors are hashed by dtype,
    shape and content (device and strides do not count).

    Raises:
        TypeError: ``value`` holds something other than the types a checkpoint may hold.
    """
    h = hashlib.sha256()
    _feed(h, value, "")
    return h.hexdigest()


_SEQUENCE_TAGS: dict[type, bytes] = {tuple: b"(", list: b"[", torch.Size: b"Z"}


def _feed(h: Any, value: Any, where: str) -> None:
    kind = type(value)
    if value is None:
        h.update(b"N")
    elif kind is bool:
        h.update(b"T" if value else b"F")
    elif kind is int:
        h.update(b"I%d;" % value)
    elif kind is float:
        h.update(b"R" + value.hex().encode() + b";")
    elif kind is str or kind is bytes:
        raw = value.encode("utf-8", "surrogatepass") if kind is str else value
        h.update(b"S" if kind is str else b"Y")
        h.update(b"%d:" % len(raw))
        h.update(raw)
    elif kind is torch.dtype:
        h.update(b"D" + str(value).encode() + b";")
    elif kind in (tuple, list, torch.Size):
        h.update(_SEQUENCE_TAGS[kind] + b"%d:" % len(value))
        for i, item in enumerate(value):
            _feed(h, item, f"{where}[{i}]")
    elif kind in (dict, OrderedDict):
        h.update(b"{%d:" % len(value))
        for k, item in value.items():
            inner = f"{where}[{k!r}]" if where else str(k)
            _feed(h, k, f"a key of {inner}")
            _feed(h, item, inner)
    elif kind in (torch.Tensor, torch.nn.Parameter):
        _feed_tensor(h, value, where)
    else:
        raise TypeError(
            f"{where or 'The value'} is a {kind.__module__}.{kind.__qualname__}; a checkpoint holds only tensors, "
            "dicts, lists, tuples, str, bytes, int, float, bool, None, torch.Size and torch.dtype "
            "(torch.load weights_only=True)."
        )


def _feed_tensor(h: Any, value: torch.Tensor, where: str) -> None:
    if value.layout != torch.strided or value.is_quantized or value.is_meta:
        raise TypeError(f"{where} is a {value.layout} tensor; a checkpoint holds only dense tensors.")
    t = value.detach().resolve_conj().resolve_neg().cpu().contiguous()
    h.update(b"X" + str(t.dtype).encode() + b"%r;" % (tuple(t.shape),))
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())
