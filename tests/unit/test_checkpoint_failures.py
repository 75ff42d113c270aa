"""Why a checkpoint write failed: the reason label comes from the errno in the exception's chain."""

from __future__ import annotations

import errno

import pytest

from ps_common.errors import CheckpointError
from ps_server.checkpoint.failures import failure_reason
from ps_server.metrics import CHECKPOINT_FAILURE_REASONS


def chained(top: BaseException, cause: BaseException) -> BaseException:
    top.__context__ = cause
    return top


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), "no_space"),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "no_space"),
        (chained(RuntimeError("unexpected pos 704 vs 598"), OSError(errno.ENOSPC, "full")), "no_space"),
        (chained(CheckpointError("x"), chained(RuntimeError("y"), OSError(errno.ENOSPC, "z"))), "no_space"),
        (PermissionError(errno.EACCES, "Permission denied"), "permission"),
        (OSError(errno.EROFS, "Read-only file system"), "permission"),
        (FileExistsError(errno.EEXIST, "File exists"), "not_a_directory"),
        (NotADirectoryError(errno.ENOTDIR, "Not a directory"), "not_a_directory"),
        (OSError(errno.EIO, "Input/output error"), "io_error"),
        (OSError("no errno"), "other"),
        (RuntimeError("unexpected pos 1 vs 0"), "other"),
    ],
)
def test_failure_reasons_come_from_the_errno_in_the_chain(exc: BaseException, reason: str) -> None:
    assert failure_reason(exc) == reason
    assert reason in CHECKPOINT_FAILURE_REASONS
