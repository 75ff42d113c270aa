"""Per-rank credentials (``ps-server --rank-tokens FILE``): a bearer token per worker rank, so a
ParameterService call's token says which rank is calling.

The file holds one ``RANK TOKEN`` per line (a decimal rank, whitespace, the token); blank lines and
lines starting with ``#`` are skipped. Each rank appears once, each token once, and a token is at
least :data:`MIN_TOKEN_CHARS` characters without whitespace. A malformed file is refused at start
with the line it stumbled on (never echoing a token).

What a caller is (:class:`Caller`), from the bearer token of its call:

- a rank's own token: that rank. Every request it sends stamped with another rank is refused with
  ``PERMISSION_DENIED`` (reason ``WRONG_RANK``) before anything changes (:func:`check_caller`).
- the shared worker token (``--token``, when also given): a worker of a rank that has no token of
  its own in the file (e.g. ranks a later resize adds). A request stamped with a rank that has its
  own token is refused the same way: only that rank's token acts as it.
- the admin token: the operator's, which may act as any rank (it already signs membership
  records, resizes and evicts).

With ``--rank-tokens`` a shard's waiting calls are shared out per rank as well
(:mod:`ps_server.service.waiting_calls`): a rank's own calls take only its share.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ps_common.errors import WrongRankError

MIN_TOKEN_CHARS = 16
"""Shortest token accepted in a rank-tokens file (a short token is guessable)."""
MAX_RANK = 4095
"""Highest rank a rank-tokens file may name (``--num-workers`` is at most 4096)."""

ADMIN = "admin"
SHARED = "shared"
RANK = "rank"


@dataclass(frozen=True)
class Caller:
    """Who a ParameterService call is, by its bearer token.

    Attributes:
        kind: :data:`RANK` (a rank's own token), :data:`SHARED` (the shared worker token) or
            :data:`ADMIN` (the admin token).
        rank: the rank of a :data:`RANK` caller; None otherwise.
    """

    kind: str
    rank: int | None = None


class RankTokens:
    """The ranks' tokens, looked up in constant time.

    Args:
        tokens: rank -> token.

    Raises:
        ValueError: a rank outside 0..MAX_RANK, a token too short or with whitespace, two ranks
            with one token, or no rank at all.
    """

    def __init__(self, tokens: Mapping[int, str]) -> None:
        if not tokens:
            raise ValueError("--rank-tokens names no rank; give one 'RANK TOKEN' line per worker rank.")
        seen: set[str] = set()
        for rank, token in tokens.items():
            if not 0 <= rank <= MAX_RANK:
                raise ValueError(f"--rank-tokens: rank {rank} is outside 0..{MAX_RANK}.")
            if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
                raise ValueError(
                    f"--rank-tokens: the token of rank {rank} must be at least {MIN_TOKEN_CHARS} characters, "
                    "without whitespace (a short token is guessable)."
                )
            if token in seen:
                raise ValueError(
                    f"--rank-tokens: rank {rank} has the token of another rank; each rank needs its own token, "
                    "or it would not say which rank is calling."
                )
            seen.add(token)
        self._tokens = {rank: token.encode() for rank, token in tokens.items()}

    @property
    def ranks(self) -> frozenset[int]:
        """The ranks that have a token of their own."""
        return frozenset(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def token_of(self, rank: int) -> str | None:
        """``rank``'s token (for ps-launch and tests), None when it has none."""
        token = self._tokens.get(rank)
        return None if token is None else token.decode()

    def rank_of(self, given: str | bytes) -> int | None:
        """The rank whose token ``given`` is, or None. Every token is compared, each in constant
        time, so the answer's timing says nothing of which rank (or how much of a token) matched."""
        raw = given.encode() if isinstance(given, str) else bytes(given)
        found = None
        for rank, token in self._tokens.items():
            if hmac.compare_digest(raw, token):
                found = rank
        return found

    def has(self, rank: int) -> bool:
        """Whether ``rank`` has a token of its own (only that token may act as it)."""
        return rank in self._tokens


def parse_rank_tokens(text: str, source: str = "--rank-tokens") -> RankTokens:
    """Parse a rank-tokens file's text (see the module docstring).

    Raises:
        ValueError: a line that is not ``RANK TOKEN``, a rank repeated, or what :class:`RankTokens` refuses;
            the message names the line, never its token.
    """
    tokens: dict[int, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        fields = stripped.split()
        if len(fields) != 2 or not fields[0].isascii() or not fields[0].isdigit():
            raise ValueError(
                f"{source} line {number} is not 'RANK TOKEN' (a decimal rank, whitespace, then the token); "
                f"it has {len(fields)} field(s)."
            )
        rank = int(fields[0])
        if rank in tokens:
            raise ValueError(f"{source} line {number} gives rank {rank} a second token; give each rank one line.")
        tokens[rank] = fields[1]
    return RankTokens(tokens)


def load_rank_tokens(path: str) -> RankTokens:
    """Read and parse the rank-tokens file at ``path``.

    Raises:
        ValueError: the file cannot be read, or :func:`parse_rank_tokens` refuses it.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise ValueError(f"--rank-tokens file {path!r} cannot be read: {why}.") from exc
    return parse_rank_tokens(text, f"--rank-tokens file {path!r}")


def caller_of(context: Any) -> Caller | None:
    """The caller of a call (None: the shard has no rank tokens, or a data connection's call,
    whose hello's token was checked against its rank instead)."""
    return getattr(context, "caller", None)


def check_caller(context: Any, rank: int, what: str, tokens: RankTokens | None) -> None:
    """Refuse a request stamped with ``rank`` that its caller may not act as.

    Args:
        context: the call's context (its :class:`Caller` in ``.caller``, see :func:`caller_of`).
        rank: the rank the request is stamped with.
        what: the method, for the message.
        tokens: the shard's rank tokens (None: no per-rank credentials, nothing to check).

    Raises:
        WrongRankError: a rank's token on a request of another rank, or the shared worker token on
            a request of a rank that has its own token (PERMISSION_DENIED, ``WRONG_RANK``).
    """
    caller = caller_of(context)
    if tokens is None or caller is None or caller.kind == ADMIN:
        return
    if caller.kind == RANK and caller.rank != rank:
        raise WrongRankError(
            f"{what} stamped rank {rank} came with the token of rank {caller.rank} (--rank-tokens): a rank's token "
            "acts only as that rank. Nothing was changed."
        )
    if caller.kind == SHARED and tokens.has(rank):
        raise WrongRankError(
            f"{what} stamped rank {rank} came with the shared worker token, but rank {rank} has its own token "
            "(--rank-tokens): only that token acts as it. Set the worker's PS_TOKEN to its rank's token. "
            "Nothing was changed."
        )
