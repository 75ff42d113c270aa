"""Waiting on processes the tests start."""

from __future__ import annotations

import re
import selectors
import subprocess
import time
from collections.abc import Callable


def wait_for_listening(proc: subprocess.Popen[str], seconds: float = 60.0) -> str:
    """Read ``proc``'s stdout (text, piped) until ``ps-server`` prints ``… listening on ADDRESS``;
    returns the address.

    Raises:
        AssertionError: the line did not come within ``seconds``, or the process exited first.
    """
    assert proc.stdout is not None
    deadline = time.monotonic() + seconds
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while proc.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(timeout=left):
                break  # no output within the deadline
            found = re.search(r"listening on (\S+)", proc.stdout.readline())
            if found:
                return found.group(1)
    raise AssertionError(f"ps-server did not report its address within {seconds:.0f} s (exit {proc.poll()})")


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``check`` (something another process does: a file it writes, a state it reaches) until
    it is True.

    Raises:
        AssertionError: ``timeout`` seconds passed first.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)  # polling with a deadline
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
