"""Why a checkpoint write failed: the metric's reason label and the message an operator reads.

Both come from the :class:`OSError` in the exception's chain (torch reports a full disk as a
``RuntimeError`` whose context is the ``OSError(ENOSPC)`` of the failed write).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

_REASON_OF_ERRNO = {
    errno.ENOSPC: "no_space",
    errno.EDQUOT: "no_space",
    errno.EACCES: "permission",
    errno.EPERM: "permission",
    errno.EROFS: "permission",
    errno.ENOTDIR: "not_a_directory",
    errno.EEXIST: "not_a_directory",
    errno.EISDIR: "not_a_directory",
}


def os_error_in(exc: BaseException) -> OSError | None:
    """The first :class:`OSError` with an errno in ``exc``'s chain (``exc`` itself, then its cause or
    context, outermost first): torch reports a full disk as ``RuntimeError: ... unexpected pos N vs M``
    with the ``OSError(ENOSPC)`` of the failed write as its context."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        current = current.__cause__ or current.__context__
    return None


def failure_reason(exc: BaseException) -> str:
    """Why a checkpoint write failed, as one of ``ps_server.metrics.CHECKPOINT_FAILURE_REASONS`` (the
    ``reason`` label of ``ps_checkpoint_failures_total``): from the errno found in
    ``exc``'s chain (``no_space``: ENOSPC or EDQUOT; ``permission``: EACCES, EPERM or EROFS;
    ``not_a_directory``: the directory or a parent is a file), ``io_error`` for another OSError,
    ``other`` when no OSError is in the chain."""
    found = os_error_in(exc)
    if found is None:
        return "other"
    return _REASON_OF_ERRNO.get(found.errno, "io_error")


def failure_message(directory: Path, what: str, exc: BaseException) -> str:
    """The message of a failed ``what`` ("create", "write <name> in") on checkpoint ``directory``:
    cause and what to do.
    The cause is the OSError in ``exc``'s chain when there is one (torch's "unexpected pos N vs
    M" on a full disk reads "No space left on device")."""
    os_error = os_error_in(exc)
    code = os_error.errno if os_error is not None else None
    reason = os_error.strerror if os_error is not None and os_error.strerror else str(exc)
    if code in (errno.ENOSPC, errno.EDQUOT):
        hint = "free some space or pass another --checkpoint-dir"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST):
        hint = f"make it a directory writable by this process (uid {os.getuid()}) or pass another --checkpoint-dir"
    else:
        hint = "check the disk and the directory, or pass another --checkpoint-dir"
    return f"Cannot {what} checkpoint directory {directory}: {reason}; {hint}."
