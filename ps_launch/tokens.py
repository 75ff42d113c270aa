"""Per-rank tokens: ``ps-launch --rank-tokens``, and the files a compose or Kubernetes deployment mounts.

With ``ps-launch --rank-tokens`` a job's shards start with ``--rank-tokens LOG_DIR/rank-tokens`` (one
``RANK TOKEN`` line per rank, :mod:`ps_server.service.rank_tokens`; mode 0600) and each worker gets
only its own rank's token, as ``PS_TOKEN`` in its environment (:func:`worker_environment`): never the
file, the shared ``PS_TOKEN`` or the admin token. A worker holding rank 1's token is then refused
``PERMISSION_DENIED`` (``WRONG_RANK``) on every request it stamps with another rank. A resumed job
(same ``--log-dir``) keeps its tokens; the ranks a ``--resize`` adds get theirs up front. Without an
admin token in ps-launch's environment one is drawn (``LOG_DIR/admin-token``, 0600) for the shards
and ps-launch's own Admin calls, so no worker can resize, evict or pose as the operator either.

``python -m ps_launch.tokens WORKERS DIR`` writes the files of a deployment (docker-compose.yml's
``secrets``, a Kubernetes Secret): ``DIR/rank-tokens`` for the shards and ``DIR/rank-R.token`` for
worker R, with ``DIR`` itself mode 0700 (deploy/README.md#per-rank-tokens).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ps_server.service.rank_tokens import parse_rank_tokens

RANK_TOKENS_FILE = "rank-tokens"
ADMIN_TOKEN_FILE = "admin-token"
TOKEN_BYTES = 32
"""Random bytes of each drawn token (``secrets.token_urlsafe``: 43 characters)."""


def _write_private(path: Path, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to ``path`` with ``mode`` from its first byte (never readable by others on the way)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, mode)  # the umask may have taken bits away from a wider mode
    os.replace(tmp, path)


def rank_tokens_file(log_dir: Path, ranks: int) -> tuple[Path, dict[int, str]]:
    """``LOG_DIR/rank-tokens`` for ranks ``0..ranks-1``: kept as it is when it already names them (a
    resumed job keeps its tokens), else written (mode 0600) with a token drawn for each rank it lacks.

    Returns:
        (its path, rank -> token).

    Raises:
        ValueError: a file already there that does not parse (its line is named, never its token).
    """
    path = log_dir / RANK_TOKENS_FILE
    tokens: dict[int, str] = {}
    if path.exists():
        found = parse_rank_tokens(path.read_text(encoding="utf-8"), f"--rank-tokens file {str(path)!r}")
        tokens = {r: found.token_of(r) or "" for r in found.ranks}
    if all(r in tokens for r in range(ranks)):
        return path, tokens
    for r in range(ranks):
        tokens.setdefault(r, secrets.token_urlsafe(TOKEN_BYTES))
    lines = "".join(f"{r} {t}\n" for r, t in sorted(tokens.items()))
    _write_private(path, "# RANK TOKEN: one per worker rank (ps-launch --rank-tokens); keep it secret\n" + lines)
    return path, tokens


def admin_token(log_dir: Path, environ: Mapping[str, str]) -> str | None:
    """The admin token to draw for a job with rank tokens: None when ``environ`` has one already
    (``PS_ADMIN_TOKEN`` or ``PS_ADMIN_TOKEN_FILE``); else ``LOG_DIR/admin-token``'s (drawn, 0600, once)."""
    if environ.get("PS_ADMIN_TOKEN", "").strip() or environ.get("PS_ADMIN_TOKEN_FILE", "").strip():
        return None
    path = log_dir / ADMIN_TOKEN_FILE
    saved = path.read_text(encoding="utf-8").strip() if path.exists() else ""
    if not saved:
        saved = secrets.token_urlsafe(TOKEN_BYTES)
        _write_private(path, saved + "\n")
    return saved


def worker_environment(tokens: Mapping[int, str] | None, rank: int) -> dict[str, str]:
    """What rank ``rank``'s worker gets over ps-launch's environment: its own token as ``PS_TOKEN``, and
    every other credential blanked (``PS_TOKEN_FILE``, ``PS_ADMIN_TOKEN``, ``PS_ADMIN_TOKEN_FILE``);
    nothing without rank tokens."""
    if tokens is None:
        return {}
    return {"PS_TOKEN": tokens[rank], "PS_TOKEN_FILE": "", "PS_ADMIN_TOKEN": "", "PS_ADMIN_TOKEN_FILE": ""}


def write_deployment_files(workers: int, out: Path) -> list[Path]:
    """``out/rank-tokens`` (the shards') and ``out/rank-R.token`` (worker R's), tokens drawn anew.

    ``out`` is made mode 0700, so no other user of the host reaches the files; the files are 0644
    because compose bind-mounts a secret's file with its host mode and owner, and the images run as
    uid 10001. Returns the files written.

    Raises:
        ValueError: ``workers`` outside 1..4096.
    """
    if not 1 <= workers <= 4096:
        raise ValueError(f"WORKERS must be in 1..4096, got {workers}.")
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    tokens = {r: secrets.token_urlsafe(TOKEN_BYTES) for r in range(workers)}
    written = [out / RANK_TOKENS_FILE]
    _write_private(written[0], "".join(f"{r} {t}\n" for r, t in tokens.items()), 0o644)
    for r, token in tokens.items():
        written.append(out / f"rank-{r}.token")
        _write_private(written[-1], token + "\n", 0o644)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ps_launch.tokens WORKERS DIR``: write a deployment's per-rank token files."""
    p = argparse.ArgumentParser(
        prog="python -m ps_launch.tokens",
        description="Write per-rank tokens for a deployment: DIR/rank-tokens (mount into every shard as "
        "PS_RANK_TOKENS_FILE) and DIR/rank-R.token (mount into worker R only, as PS_TOKEN_FILE).",
    )
    p.add_argument("workers", type=int, help="number of worker ranks")
    p.add_argument("dir", type=Path, help="directory to write (made mode 0700); existing tokens are replaced")
    args = p.parse_args(argv)
    try:
        written = write_deployment_files(args.workers, args.dir)
    except (ValueError, OSError) as exc:
        print(f"ps_launch.tokens: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files in {args.dir}: {RANK_TOKENS_FILE} and rank-0..{args.workers - 1}.token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
