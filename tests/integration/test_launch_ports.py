"""ps-launch holds its shards' ports while they start (so the workers start beside them): nothing
else may take a held port, the shard told --reuse-port binds it, and a plain server still cannot."""

from __future__ import annotations

import socket

import pytest

from ps_launch.cluster import reserve_ports
from ps_server.config import ServerConfig, config_from_args
from ps_server.server import start_server


def test_held_ports_are_distinct_and_refused_to_a_plain_bind() -> None:
    held = reserve_ports(2)
    try:
        ports = [s.getsockname()[1] for s in held]
        assert len(set(ports)) == 2 and all(p > 0 for p in ports)
        for port in ports:
            with socket.socket() as other, pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()
    with socket.socket() as other:  # closed: the port is free again
        other.bind(("127.0.0.1", ports[0]))


def test_a_shard_with_reuse_port_serves_on_a_held_port_and_a_plain_one_is_refused() -> None:
    (held,) = reserve_ports(1)
    port = held.getsockname()[1]
    running = None
    try:
        running = start_server(ServerConfig(shard_index=0, num_shards=1, num_workers=1, port=port, reuse_port=True))
        assert running.address == f"127.0.0.1:{port}"
        held.close()
        with pytest.raises(RuntimeError):  # never two shards on one port by mistake
            start_server(ServerConfig(shard_index=0, num_shards=1, num_workers=1, port=port))
    finally:
        held.close()
        if running is not None:
            running.stop()


def test_reuse_port_is_off_unless_asked() -> None:
    assert (
        config_from_args(["--shard-index", "0", "--num-shards", "1", "--num-workers", "1"], environ={})[0].reuse_port
        is False
    )
    on, _ = config_from_args(
        ["--shard-index", "0", "--num-shards", "1", "--num-workers", "1", "--reuse-port"], environ={}
    )
    assert on.reuse_port is True
