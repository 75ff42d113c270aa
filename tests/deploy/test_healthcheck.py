"""``python -m ps_server.healthcheck`` against a real shard on 127.0.0.1:0."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from ps_server import healthcheck
from ps_server.config import ServerConfig
from ps_server.server import ShardServer, start_server


@pytest.fixture
def shard() -> Iterator[ShardServer]:
    server = start_server(ServerConfig(shard_index=0, num_shards=1, num_workers=1, port=0))
    try:
        yield server
    finally:
        server.stop(grace=0.5)


def test_serving_shard_exits_zero(shard: ShardServer) -> None:
    assert healthcheck.main([shard.address, "--timeout", "5"]) == 0


@pytest.mark.parametrize("service", ["", "ps.v1.ParameterService", "ps.v1.Admin"])
def test_every_service_reports_serving(shard: ShardServer, service: str) -> None:
    serving, text = healthcheck.check(shard.address, service, timeout=5)
    assert serving, text
    assert text.endswith("SERVING")


def test_unknown_service_exits_one(shard: ShardServer) -> None:
    assert healthcheck.main([shard.address, "--service", "no.such.Service", "--timeout", "5"]) == 1


def test_stopping_shard_exits_one() -> None:
    server = start_server(ServerConfig(shard_index=0, num_shards=1, num_workers=1, port=0))
    address = server.address
    assert healthcheck.main([address, "--timeout", "5"]) == 0
    server.stop(grace=0.5)
    assert healthcheck.main([address, "--timeout", "2"]) == 1


def test_default_address_follows_ps_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PS_PORT", "50099")
    assert healthcheck.default_address() == "127.0.0.1:50099"
    monkeypatch.setenv("PS_PORT", "0")
    assert healthcheck.default_address() == "127.0.0.1:50051"
    monkeypatch.delenv("PS_PORT")
    assert healthcheck.default_address() == "127.0.0.1:50051"


def test_runs_as_module_without_importing_torch(shard: ShardServer) -> None:
    """The container runs it every few seconds: it must not pay torch's import time."""
    probe = (
        "import sys, runpy; sys.argv = ['healthcheck', sys.argv[1]]\n"
        "try:\n"
        "    runpy.run_module('ps_server.healthcheck', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    print('torch' in sys.modules, exc.code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, shard.address], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip().splitlines()[-1] == "False 0", done.stdout + done.stderr


def test_command_line_exit_codes(shard: ShardServer) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "ps_server.healthcheck", shard.address], capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0, ok.stderr
    assert "SERVING" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "ps_server.healthcheck", "--timeout", "0"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2
