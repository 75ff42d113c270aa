"""Hostile data connections (``--data-port``) against a real shard: hellos of ranks outside the
cluster, frames of ranks that are not live members, frames parked and never taken or never
completed, and a flood of refused connections. Nothing is parked for a non-member, a parked frame
is released after ``--data-frame-timeout``, parked bytes stay within ``--max-parked-bytes``, and
the refusals are counted and logged at a bounded rate.
"""

from __future__ import annotations

import logging
import socket
import time

import pytest
import torch

from ps_common import dataconn
from ps_server.dataplane.connections import REFUSED
from ps_worker import PSClient
from tests.conftest import RPC_TIMEOUT
from tests.helpers.data_connections import closed_by_peer, raw_connection

INCARNATION = 1
SESSIONS: dict[int, int] = {}
"""The session of each rank the fixture joined (``JoinResponse.session``)."""


def model() -> torch.nn.Module:
    """Linear 512 -> 512 (1 MiB of float32 parameters)."""
    torch.manual_seed(0)
    return torch.nn.Linear(512, 512)


@pytest.fixture
def member(start_cluster):
    """One initialized shard of a 2-worker async job with data connections; rank 0 joined
    (incarnation 1), rank 1 never joins. Parked frames expire after 0.5 s."""
    cluster = start_cluster(num_shards=1, num_workers=2, mode="async", data_port=0, data_frame_timeout=0.5)
    client = PSClient(cluster.addresses, 0, 2, incarnation=INCARNATION, timeout=RPC_TIMEOUT)
    client.init(model(), {"name": "sgd", "lr": 0.1})
    SESSIONS[0] = client.session.sessions[0]  # rank 0's session: its hellos carry it
    yield cluster[0]
    client.close()
    SESSIONS.clear()


def frame_slots(shard) -> list[torch.Tensor]:
    """Zeros for every partition the shard owns, in its parameters' dtypes (a whole push frame)."""
    plan = shard.shard.plan
    return [torch.zeros(p.length, dtype=torch.float32) for p in plan.owned_by(shard.config.shard_index)]


def hello(port: int, rank: int, incarnation: int = INCARNATION) -> tuple[socket.socket, tuple[int, ...]]:
    """A hello of ``rank`` (with its session when the fixture joined it) and the shard's reply."""
    sock = raw_connection(port, rank=rank, incarnation=incarnation, session=SESSIONS.get(rank, 0))
    return sock, dataconn.recv_struct(sock, dataconn.REPLY, time.monotonic() + RPC_TIMEOUT)


def send_quietly(sock: socket.socket, buffers: list) -> None:
    """Send what the shard may refuse midway (it closes the connection: not an error here)."""
    try:
        dataconn.send_all(sock, buffers, time.monotonic() + RPC_TIMEOUT)
    except (OSError, dataconn.DataConnectionError):
        pass


def test_hellos_of_ranks_outside_the_cluster_are_refused_and_park_nothing(member) -> None:
    """The issue's attack: 16 connections with hello ranks 100-115, each sending a complete frame
    and a partial one of the shard's partitions. Each hello is refused at once (status
    INVALID_ARGUMENT, connection closed), nothing is parked, every refusal is counted."""
    plane = member.data
    slots = frame_slots(member)
    before = member.counters.rejected
    socks = []
    for rank in range(100, 116):
        sock, reply = hello(plane.port, rank)
        assert reply == (dataconn.MAGIC, REFUSED)
        send_quietly(sock, dataconn.frame(1, slots) + dataconn.record(2, 0, slots[0])[:1])
        socks.append(sock)
    for sock in socks:
        assert closed_by_peer(sock)
        sock.close()
    assert plane.parked_bytes == 0
    assert member.counters.rejected - before == 16


@pytest.mark.parametrize(
    "rank, incarnation, why",
    [(1, INCARNATION, "never joined"), (0, INCARNATION - 1, "an older incarnation"), (0, 9, "not joined as 9")],
)
def test_a_frame_of_a_rank_that_is_not_a_live_member_is_refused_at_its_first_record(
    member, rank: int, incarnation: int, why: str
) -> None:
    plane = member.data
    slots = frame_slots(member)
    sock, reply = hello(plane.port, rank, incarnation)
    assert reply == (dataconn.MAGIC, 0), why  # in the cluster: the frames are what is checked
    sock.sendall(dataconn.record(1, 0, slots[0])[0])  # the first record alone: refused before its bytes
    assert closed_by_peer(sock), why
    sock.close()
    assert plane.parked_bytes == 0
    assert member.shard.version == 0


def test_a_parked_frame_of_a_member_expires(member, wait_until) -> None:
    """Rank 0 (a live member) parks a complete frame nobody takes and then a partial one that
    never completes: both are released within the frame timeout (0.5 s here), the partial one by
    closing its connection."""
    plane = member.data
    slots = frame_slots(member)
    sock, reply = hello(plane.port, 0)
    assert reply == (dataconn.MAGIC, 0)
    dataconn.send_all(sock, dataconn.frame(1, slots), time.monotonic() + RPC_TIMEOUT)
    wait_until(lambda: plane.parked_bytes == sum(s.numel() * 4 for s in slots), RPC_TIMEOUT, "frame 1 parked")
    wait_until(lambda: plane.parked_bytes == 0, RPC_TIMEOUT, "the untaken frame released")
    assert not closed_by_peer_within(sock, 0.2)  # a complete frame expiring keeps the connection
    record, data = dataconn.record(2, 0, slots[0])
    dataconn.send_all(sock, [record, memoryview(data)[: len(data) // 2]], time.monotonic() + RPC_TIMEOUT)
    wait_until(lambda: plane.parked_bytes > 0, RPC_TIMEOUT, "frame 2 begun")
    assert closed_by_peer(sock)  # the partial frame: its connection closed
    wait_until(lambda: plane.parked_bytes == 0, RPC_TIMEOUT, "the partial frame released")
    assert plane.expired >= 2
    sock.close()


def closed_by_peer_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    finally:
        sock.settimeout(RPC_TIMEOUT)


def test_parked_bytes_are_bounded(start_cluster) -> None:
    """A member's frame beyond ``--max-parked-bytes`` closes its connection before its bytes are read."""
    cluster = start_cluster(num_shards=1, num_workers=1, mode="async", data_port=0, max_parked_bytes=64 << 10)
    with PSClient(cluster.addresses, 0, 1, incarnation=INCARNATION, timeout=RPC_TIMEOUT) as client:
        client.init(model(), {"name": "sgd", "lr": 0.1})
        plane = cluster[0].data
        slots = frame_slots(cluster[0])
        assert slots[0].numel() * 4 > 64 << 10
        sock, reply = hello(plane.port, 0)
        assert reply == (dataconn.MAGIC, 0)
        sock.sendall(dataconn.record(1, 0, slots[0])[0])
        assert closed_by_peer(sock)
        sock.close()
        assert plane.parked_bytes == 0


def test_refused_connections_are_logged_at_a_bounded_rate(start_cluster, caplog) -> None:
    """64 connections with a wrong token: every one refused and counted, a WARNING line or two."""
    cluster = start_cluster(num_shards=1, num_workers=1, data_port=0, token="tok", admin_token="adm")
    before = cluster[0].counters.rejected
    with caplog.at_level(logging.WARNING, logger="ps_server.dataplane.connections"):
        for _ in range(64):
            sock = raw_connection(cluster[0].data.port, rank=0, token="wrong")
            assert closed_by_peer(sock)
            sock.close()
    lines = [r for r in caplog.records if r.name == "ps_server.dataplane.connections" and r.levelno == logging.WARNING]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]
    assert cluster[0].counters.rejected - before == 64
