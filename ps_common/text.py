"""Client text made safe for one log line or one error message: quoted, escaped, cut short."""

from __future__ import annotations

QUOTE_CHARS = 80
"""Characters of client text kept by :func:`quote`."""

DETAIL_CHARS = 1024
"""Most characters of a refusal's message (:func:`shown`)."""

_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)} | {0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}


def quote(text: str, limit: int = QUOTE_CHARS) -> str:
    """``text`` as a Python literal (newlines and control characters escaped), cut to ``limit``
    characters with its full length in bytes appended when longer.

    >>> quote("fc1.weight")
    "'fc1.weight'"
    >>> quote("a" * 100, 4)
    "'aaaa'… (100 bytes)"
    """
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text.encode('utf-8', 'replace'))} bytes)"


def shown(message: str, limit: int = DETAIL_CHARS) -> str:
    """A refusal's ``message`` made safe for a status detail and one log line: control characters
    (a newline that would start a forged log line) escaped, at most ``limit`` characters."""
    safe = message.translate(_CONTROL)
    return safe if len(safe) <= limit else safe[: limit - 1] + "…"
