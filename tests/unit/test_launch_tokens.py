"""ps_launch.tokens: the per-rank token files of ``ps-launch --rank-tokens`` and of a deployment."""

from __future__ import annotations

import stat

import pytest

from ps_launch.cli import launch_parser
from ps_launch.tokens import (
    admin_token,
    main,
    rank_tokens_file,
    worker_environment,
    write_deployment_files,
)
from ps_server.service.rank_tokens import load_rank_tokens


def mode(path) -> int:  # noqa: ANN001
    return stat.S_IMODE(path.stat().st_mode)


def test_a_job_s_tokens_are_private_kept_on_resume_and_grown_for_new_ranks(tmp_path) -> None:
    path, tokens = rank_tokens_file(tmp_path, 2)
    assert path == tmp_path / "rank-tokens" and mode(path) == 0o600
    assert sorted(tokens) == [0, 1] and len(set(tokens.values())) == 2
    parsed = load_rank_tokens(str(path))  # what ps-server --rank-tokens reads
    assert {r: parsed.token_of(r) for r in parsed.ranks} == tokens
    assert rank_tokens_file(tmp_path, 2) == (path, tokens)  # a resumed job keeps them
    _, grown = rank_tokens_file(tmp_path, 3)  # a larger job (or a --resize) adds rank 2 only
    assert {r: grown[r] for r in (0, 1)} == tokens and len(set(grown.values())) == 3 and mode(path) == 0o600
    (tmp_path / "rank-tokens").write_text("0 a-secret-token-0123456789 extra\n")
    with pytest.raises(ValueError, match="line 1 is not 'RANK TOKEN'") as err:
        rank_tokens_file(tmp_path, 2)
    assert "a-secret-token" not in str(err.value)  # never the token


def test_an_admin_token_is_drawn_only_without_one(tmp_path) -> None:
    assert admin_token(tmp_path, {"PS_ADMIN_TOKEN": "mine"}) is None
    assert admin_token(tmp_path, {"PS_ADMIN_TOKEN_FILE": "/run/secrets/admin"}) is None
    drawn = admin_token(tmp_path, {})
    assert drawn and len(drawn) >= 40 and mode(tmp_path / "admin-token") == 0o600
    assert admin_token(tmp_path, {}) == drawn  # once per log directory


def test_a_worker_gets_its_own_token_and_no_other_credential() -> None:
    assert worker_environment(None, 0) == {}
    env = worker_environment({0: "zero-token-0123456789", 1: "one-token-0123456789"}, 1)
    assert env == {
        "PS_TOKEN": "one-token-0123456789",
        "PS_TOKEN_FILE": "",
        "PS_ADMIN_TOKEN": "",
        "PS_ADMIN_TOKEN_FILE": "",
    }


def test_ps_launch_takes_rank_tokens_as_a_switch() -> None:
    assert launch_parser({}).parse_args(["--rank-tokens", "digits"]).rank_tokens is True
    assert launch_parser({"PS_RANK_TOKENS": "1"}).parse_args(["digits"]).rank_tokens is True
    assert launch_parser({}).parse_args(["digits"]).rank_tokens is False


def test_deployment_files_one_per_worker_in_a_private_directory(tmp_path, capsys) -> None:
    out = tmp_path / "secrets"
    assert main(["3", str(out)]) == 0
    assert "wrote 4 files" in capsys.readouterr().out
    assert mode(out) == 0o700  # no other user of the host reaches them
    shards = load_rank_tokens(str(out / "rank-tokens"))
    assert shards.ranks == {0, 1, 2}
    for r in range(3):
        own = out / f"rank-{r}.token"
        assert own.read_text().strip() == shards.token_of(r)
        assert mode(own) == 0o644  # compose bind-mounts it as it is; the images run as uid 10001
    with pytest.raises(ValueError, match="1..4096"):
        write_deployment_files(0, out)
    assert main(["0", str(out)]) == 2
