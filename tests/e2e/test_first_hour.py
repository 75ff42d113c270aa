"""A user's first hour (issue 12): every mistake answered at once and by name, every summary true.

Real shards over real gRPC on 127.0.0.1:0; the CLI as a user runs it (subprocess), with bounded waits.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch

from ps_server.config import ServerConfig
from ps_server.server import start_server
from ps_worker import PSClient
from ps_worker.errors import RoundTimeoutError, ShardError, ShardUnreachableError
from tests.conftest import small_model


def dead_address() -> str:
    """``127.0.0.1:PORT`` where nothing listens (a port bound, read and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def shards():
    started = []

    def start(n: int = 1, num_workers: int = 1, **config):
        for k in range(n):
            started.append(
                start_server(ServerConfig(shard_index=k, num_shards=n, num_workers=num_workers, port=0, **config))
            )
        return started[-n:]

    yield start
    for s in started:
        s.stop(grace=0.5)


# ---------------------------------------------------------------------- item 1: unreachable shards
def test_item1_unreachable_shard_is_named_within_seconds(shards) -> None:
    """One shard of two not started: the client names that address within --retry-deadline, not the
    60 s --timeout."""
    (good,) = shards(2, 1)[:1]
    dead = dead_address()
    client = PSClient([f"127.0.0.1:{good.port}", dead], rank=0, num_workers=1, timeout=60.0, retry_deadline=3.0)
    start = time.monotonic()
    try:
        with pytest.raises(ShardUnreachableError) as err:
            client.init(small_model(), {"name": "sgd", "lr": 0.1})
    finally:
        client.close()
    assert time.monotonic() - start < 10
    assert err.value.address == dead
    assert dead in str(err.value) and "is the shard running? check --servers" in str(err.value)
    assert isinstance(err.value, ShardError)  # and a grpc.RpcError: .code() still works
    assert err.value.code().name in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


@pytest.mark.parametrize("which", ["nothing listening", "one shard of two"])
def test_item1_ps_worker_names_the_unreachable_address(shards, which) -> None:
    dead = dead_address()
    servers = dead if which == "nothing listening" else f"127.0.0.1:{shards(2, 1)[0].port},{dead}"
    argv = [sys.executable, "-m", "ps_worker.cli", "--servers", servers, "--rank", "0", "--num-workers", "1"]
    argv += ["--retry-deadline", "3", "--metrics-port", "-1", "digits"]
    start = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert out.returncode == 1, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ps-worker rank 0: Shard " + dead), out.stderr[-2000:]
    assert "is the shard running? check --servers" in last
    assert "Traceback" not in out.stderr
    # before: Join waited the whole --timeout (60 s) whatever --retry-deadline said
    assert took < 50, f"took {took:.0f} s"


# ---------------------------------------------------------------------- item 2: round timeout names ranks
def test_item2_round_timeout_names_the_missing_rank(shards) -> None:
    """A sync round waiting for an absent rank 1: the Python API raises RoundTimeoutError with
    .ranks == [1] and the shard's own words, not a raw _InactiveRpcError."""
    (shard,) = shards(1, 2)
    model = small_model()
    client = PSClient([f"127.0.0.1:{shard.port}"], rank=0, num_workers=2, timeout=3.0, retry_deadline=1.0)
    try:
        client.init(model, {"name": "sgd", "lr": 0.1})
        params = {k: p.data for k, p in model.named_parameters()}
        grads = {k: torch.ones_like(p) for k, p in model.named_parameters()}
        with pytest.raises(RoundTimeoutError) as err:
            client.push_pull(grads, params)
    finally:
        client.close()
    assert err.value.ranks == [1]
    assert err.value.code().name == "DEADLINE_EXCEEDED"
    assert "round waits for ranks [1]" in str(err.value) and "check those workers" in str(err.value)
    assert err.value.address == f"127.0.0.1:{shard.port}"
