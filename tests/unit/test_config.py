"""Flags, their PS_* twins, and config validation."""

from __future__ import annotations

import pytest

from ps_common.channels import is_loopback
from ps_common.errors import InvalidRequestError
from ps_server.config import ServerConfig, config_from_args, server_parser

BASE = ["--shard-index", "0", "--num-shards", "2", "--num-workers", "2"]


def test_env_twins_fill_in_and_flags_win() -> None:
    env = {"PS_SHARD_INDEX": "1", "PS_NUM_SHARDS": "2", "PS_NUM_WORKERS": "4", "PS_PORT": "123", "PS_INSECURE": "1"}
    config, _ = config_from_args([], environ=env)
    assert (config.shard_index, config.num_workers, config.port, config.insecure) == (1, 4, 123, True)
    config, _ = config_from_args(["--port", "7"], environ=env)
    assert config.port == 7


def test_bad_twin_value_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        config_from_args(BASE, environ={"PS_PORT": "eighty"})
    assert "PS_PORT='eighty'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "ssp2"}, "Unknown mode 'ssp2'; expected one of async, diloco, easgd, ssp, sync."),
        ({"shard_index": 2}, "--shard-index must be in 0..1"),
        ({"num_workers": 0}, "--num-workers"),
        ({"lease_timeout": 0}, "--lease-timeout"),
        ({"host": "0.0.0.0"}, "Refusing to serve on non-loopback address"),
        ({"host": "0.0.0.0", "token": "t"}, "without both PS_TOKEN and PS_ADMIN_TOKEN"),
        ({"host": "0.0.0.0", "token": " \t", "admin_token": "a"}, "--token (PS_TOKEN) is only whitespace"),
        ({"host": "0.0.0.0", "token": "w", "admin_token": "  "}, "--admin-token (PS_ADMIN_TOKEN) is only whitespace"),
        ({"token": "   "}, "--token (PS_TOKEN) is only whitespace; give a real secret, or leave it empty."),
        ({"host": "0.0.0.0", "token": "same", "admin_token": "same"}, "with PS_TOKEN equal to PS_ADMIN_TOKEN"),
        ({"max_watch_streams": 0}, "--max-watch-streams must be in 1..1024, got 0."),
        ({"max_public_streams": 1025}, "--max-public-streams must be in 1..1024, got 1025."),
        ({"max_waiting_calls": -1}, "--max-waiting-calls must be in 0..65536 (0: 2 per worker plus 8), got -1."),
    ],
)
def test_invalid_configs_are_refused_in_a_full_sentence(kwargs, message) -> None:
    fields = {"shard_index": 0, "num_shards": 2, "num_workers": 2, **kwargs}
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ServerConfig(**fields)


def test_non_loopback_is_allowed_with_tokens_or_insecure() -> None:
    ServerConfig(0, 1, 1, host="0.0.0.0", token="a", admin_token="b")
    ServerConfig(0, 1, 1, host="0.0.0.0", insecure=True)
    ServerConfig(0, 1, 1, host="0.0.0.0", token="same", admin_token="same", insecure=True)
    ServerConfig(0, 1, 1, token="same", admin_token="same")  # loopback: one secret for both is a choice


def test_stream_limits_have_flags_and_a_pool_of_their_own() -> None:
    config, _ = config_from_args([*BASE, "--max-watch-streams", "4"], environ={"PS_MAX_PUBLIC_STREAMS": "8"})
    assert (config.max_watch_streams, config.max_public_streams) == (4, 8)
    assert config.stream_threads == 4 + 8 + 4
    default, _ = config_from_args(BASE, environ={})
    assert (default.max_watch_streams, default.max_public_streams) == (16, 64)
    assert default.threads == 16  # the data plane's pool: 2 per worker + 8, at least 16


def test_waiting_calls_have_a_flag_and_a_pool_of_their_own() -> None:
    default, _ = config_from_args(BASE, environ={})
    assert default.max_waiting_calls == 0
    assert default.waiting_calls == 2 * default.num_workers + 8  # sync needs one per worker
    assert default.wait_threads == default.waiting_calls + 4  # and threads that refuse at once
    flagged, _ = config_from_args([*BASE, "--max-waiting-calls", "5"], environ={"PS_MAX_WAITING_CALLS": "9"})
    twin, _ = config_from_args(BASE, environ={"PS_MAX_WAITING_CALLS": "9"})
    assert (flagged.waiting_calls, twin.waiting_calls) == (5, 9)


@pytest.mark.parametrize(
    ("host", "loop"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("10.77.0.3", False),
        ("fe80::1", False),
        ("ps-0", False),
        ("ps-0.ps.grpc-ps.svc", False),
    ],
)
def test_is_loopback(host: str, loop: bool) -> None:
    assert is_loopback(host) is loop


def test_tokens_from_files(tmp_path) -> None:
    (tmp_path / "worker").write_text("w-secret\n")
    (tmp_path / "admin").write_text("  a-secret ")
    args = [*BASE, "--token-file", str(tmp_path / "worker"), "--admin-token-file", str(tmp_path / "admin")]
    config, _ = config_from_args(args, environ={})
    assert (config.token, config.admin_token) == ("w-secret", "a-secret")


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--token", "x", "--token-file", "F"], "not both"), (["--token-file", "/nonexistent/t"], "cannot be read")],
)
def test_bad_token_files_are_clear_errors(tmp_path, capsys, extra, message) -> None:
    extra = [str(tmp_path / "t") if e == "F" else e for e in extra]
    (tmp_path / "t").write_text("x")
    with pytest.raises(SystemExit):
        config_from_args([*BASE, *extra], environ={})
    assert message in capsys.readouterr().err


def test_a_worker_token_without_an_admin_token_is_warned_about() -> None:
    open_admin = ServerConfig(shard_index=0, num_shards=1, num_workers=1, token="w")
    (warning,) = open_admin.warnings()
    assert "--admin-token" in warning and "without a token" in warning and "PS_ADMIN_TOKEN_FILE" in warning
    assert ServerConfig(shard_index=0, num_shards=1, num_workers=1, token="w", admin_token="a").warnings() == []
    assert ServerConfig(shard_index=0, num_shards=1, num_workers=1).warnings() == []


def test_every_token_flag_says_the_command_line_is_visible_and_what_to_use_instead() -> None:
    from ps_admin.cli import admin_parser
    from ps_launch.cli import launch_parser
    from ps_worker.workloads.cli import worker_parser

    for parser, flags in (
        (server_parser({}), ("--token", "--admin-token")),
        (worker_parser({}), ("--token",)),
        (admin_parser({}), ("--admin-token",)),
    ):
        helps = {a.option_strings[0]: " ".join(a.help.split()) for a in parser._actions if a.option_strings}
        for flag in flags:
            assert "/proc/PID/cmdline" in helps[flag] and "_FILE" in helps[flag], (parser.prog, flag)
    epilog = " ".join(launch_parser({}).epilog.split())
    assert "never on its command line" in epilog and "PS_TOKEN_FILE" in epilog


def test_ps_admin_reads_the_admin_token_from_a_file(tmp_path, monkeypatch) -> None:
    from ps_admin import cli

    path = tmp_path / "admin-token"
    path.write_text("s3cret\n")
    seen = {}
    monkeypatch.setitem(cli.COMMANDS, "checkpoint", lambda args, out, err: seen.setdefault("token", args.admin_token))
    cli.main(["--servers", "127.0.0.1:1", "--admin-token-file", str(path), "checkpoint"])
    assert seen == {"token": "s3cret"}


@pytest.mark.parametrize("bad", ["a b", "x" * 65, "job/1", "jöb"])
def test_a_cluster_id_is_short_and_plain(bad: str) -> None:
    with pytest.raises(InvalidRequestError, match="--cluster-id"):
        ServerConfig(shard_index=0, num_shards=1, num_workers=1, cluster_id=bad)
    assert ServerConfig(shard_index=0, num_shards=1, num_workers=1, cluster_id="job-7_2026.11:25").cluster_id
