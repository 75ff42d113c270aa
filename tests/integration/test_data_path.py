"""PushPull's partitions on the data connection (``--data-port``) beside gRPC: the same bits as the
gRPC stream, the same refusals, a fallback to gRPC when the connection fails, and bounded,
checked input on the shard's side."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import grpc
import pytest
import torch

from ps_common import dataconn
from ps_common.errors import DataPathError
from ps_proto.v1 import ps_pb2
from ps_worker import PSClient
from ps_worker.workloads.train import params_sha256
from tests.conftest import RPC_TIMEOUT
from tests.helpers.data_connections import closed_by_peer, raw_connection
from tests.helpers.ranks import train_ranks

STEPS = 6
BATCH = 8
PARTITION_BYTES = 4096  # several messages per shard: PushPull streams, not PushPullOnce
OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def model(seed: int = 0) -> torch.nn.Module:
    """MLP 16 -> 128 -> 64 -> 3 (10,627 parameters, 42 KB: several 4 KiB partitions per shard)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3)
    )


def train(
    addresses: list[str],
    n: int,
    data_path: str,
    wire_dtype: str | None = None,
    overlap: bool = True,
    between: Callable[[int], None] | None = None,
) -> tuple[list[torch.nn.Module], list[list[bool]]]:
    """``n`` worker threads, STEPS sync steps each (:func:`tests.helpers.ranks.train_ranks`);
    ``between(step)`` runs on rank 0 after its backward, before its step."""
    return train_ranks(
        addresses,
        n,
        model,
        STEPS,
        BATCH,
        OPTIMIZER,
        before_step=None if between is None else lambda rank, t: between(t) if rank == 0 else None,
        overlap=overlap,
        partition_bytes=PARTITION_BYTES,
        wire_dtype=wire_dtype,
        data_path=data_path,
    )


@pytest.mark.parametrize("wire_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("overlap", [True, False])
def test_data_path_is_bitwise_the_grpc_path(start_cluster, wire_dtype, overlap) -> None:
    """2 workers x 2 shards, sync: the data connections give the same bits as the gRPC stream, with
    partitions sent during backward (overlap) or at step(), in float32 or bfloat16 on the wire."""
    on = start_cluster(num_shards=2, num_workers=2, data_port=0)
    got, connected = train(on.addresses, 2, "tcp", wire_dtype, overlap)
    assert connected == [[True, True], [True, True]]
    off = start_cluster(num_shards=2, num_workers=2, data_port=0)
    want, unused = train(off.addresses, 2, "grpc", wire_dtype, overlap)
    assert unused == [[False, False], [False, False]]
    assert params_sha256(got[0]) == params_sha256(got[1]) == params_sha256(want[0])
    # the data connections' bytes are counted with PushPull's
    counted = on[0].counters.view()
    params_bytes = sum(p.numel() * 4 for p in got[0].parameters()) // (2 if wire_dtype else 1)
    # each of 2 ranks pushes about half the model to shard 0 per step, and pulls it back
    assert counted.received_bytes["ps.v1.ParameterService/PushPull"] > STEPS * params_bytes * 0.5
    assert counted.sent_bytes["ps.v1.ParameterService/PushPull"] > STEPS * params_bytes * 0.5


def test_shard_without_data_port_and_tls_get_grpc(start_cluster) -> None:
    """A shard started with data_port=-1 offers none (Join says 0): the worker uses gRPC alone."""
    off = start_cluster(num_shards=1, num_workers=1)
    _, connected = train(off.addresses, 1, "tcp")
    assert connected == [[False]]


def test_a_lost_connection_falls_back_to_grpc_and_loses_nothing(start_cluster) -> None:
    """The shard closes every data connection between steps (its data plane stops): the next step's
    push goes again on gRPC with the same stamp, and every round is applied exactly once."""
    cluster = start_cluster(num_shards=1, num_workers=1, data_port=0)

    def cut(step: int) -> None:
        if step == 3:
            assert cluster[0].data is not None
            cluster[0].data.close()

    got, connected = train(cluster.addresses, 1, "tcp", between=cut)
    assert connected == [[False]]  # gRPC since the cut
    assert cluster[0].shard.version == STEPS
    reference = start_cluster(num_shards=1, num_workers=1)
    want, _ = train(reference.addresses, 1, "grpc")
    assert params_sha256(got[0]) == params_sha256(want[0])


# ---------------------------------------------------------------------- the shard's side, raw
@pytest.fixture
def initialized(start_cluster):
    """One shard with data connections, initialized by a worker that stays joined."""
    cluster = start_cluster(num_shards=1, num_workers=1, data_port=0, token="tok", admin_token="adm")
    client = PSClient(
        cluster.addresses, 0, 1, incarnation=1, timeout=RPC_TIMEOUT, partition_bytes=PARTITION_BYTES, token="tok"
    )
    m = model()
    client.init(m, {"name": "sgd", "lr": 0.1})
    yield cluster, client, m
    client.close()


def test_hello_with_a_wrong_token_is_closed(initialized) -> None:
    cluster, _, _ = initialized
    port = cluster[0].data.port
    sock = raw_connection(port, token="wrong")
    assert closed_by_peer(sock)
    good = raw_connection(port, token="tok")
    reply = dataconn.recv_struct(good, dataconn.REPLY, time.monotonic() + RPC_TIMEOUT)
    assert reply == (dataconn.MAGIC, 0)
    good.close()
    bad = socket.create_connection(("127.0.0.1", port), timeout=RPC_TIMEOUT)
    bad.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64))  # not a data connection
    assert closed_by_peer(bad)


@pytest.mark.parametrize(
    "record",
    [
        (1, 999, ps_pb2.DTYPE_FLOAT32, 4096),  # a slot the shard does not have
        (1, 0, ps_pb2.DTYPE_FLOAT32, 1 << 40),  # more bytes than the partition: refused before reading
        (1, 0, ps_pb2.DTYPE_FLOAT64, 8192),  # wider than the parameter
        (1, 0, 77, 4096),  # no such dtype
        (1, dataconn.END, 0, 3),  # a frame that ends with partitions missing
    ],
)
def test_a_record_outside_the_plan_closes_the_connection_and_changes_nothing(initialized, record) -> None:
    cluster, client, m = initialized
    shard = cluster[0].shard
    before = (shard.version, params_sha256(m))
    sock = raw_connection(cluster[0].data.port, rank=0, incarnation=1, token="tok")  # the joined rank's
    assert dataconn.recv_struct(sock, dataconn.REPLY, time.monotonic() + RPC_TIMEOUT) == (dataconn.MAGIC, 0)
    sock.sendall(dataconn.RECORD.pack(*record))
    assert closed_by_peer(sock)
    # the shard keeps serving, over the data connection too, and applied nothing of the bad frame
    assert shard.version == before[0]
    grads = {k: torch.zeros_like(p) for k, p in m.named_parameters()}
    client.push_pull(grads, {k: p.data for k, p in m.named_parameters()})
    assert shard.version == before[0] + 1
    assert client.transport.data_connected == [True]


def test_a_non_finite_gradient_on_the_data_path_is_refused_whole(initialized) -> None:
    cluster, client, m = initialized
    shard = cluster[0].shard
    params = {k: p.data for k, p in m.named_parameters()}
    before = (shard.version, params_sha256(m))
    grads = {k: torch.zeros_like(p) for k, p in m.named_parameters()}
    grads["4.weight"][1, 2] = float("nan")
    with pytest.raises(grpc.RpcError) as refused:
        client.push_pull(grads, params)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "finite" in refused.value.details().lower() or "nan" in refused.value.details().lower()
    assert (shard.version, params_sha256(m)) == before
    assert client.transport.data_connected == [True]  # refused on gRPC, the connection stays


def test_connections_are_bounded(start_cluster) -> None:
    """No more than the data plane's thread bound (max(16, 2 x workers + 8)) connections at once
    (here waiting for their hellos): one more is closed before its hello is read."""
    cluster = start_cluster(num_shards=1, num_workers=1, data_port=0)
    plane = cluster[0].data
    socks: list[socket.socket] = []
    for _ in range(plane.max_connections):
        socks.append(socket.create_connection(("127.0.0.1", plane.port), timeout=RPC_TIMEOUT))
    extra = raw_connection(plane.port, rank=0)
    assert closed_by_peer(extra)
    for s in socks:
        s.close()


def test_sending_to_a_peer_that_stops_reading_is_bounded(start_cluster) -> None:
    """A worker that stops reading holds neither the shard's sender nor a worker's: each send
    gives up at its deadline, and the shard closes that connection."""
    cluster = start_cluster(num_shards=1, num_workers=4, data_port=0)
    plane = cluster[0].data
    sock = raw_connection(plane.port, rank=3)
    dataconn.recv_struct(sock, dataconn.REPLY, time.monotonic() + RPC_TIMEOUT)
    big = torch.zeros(16 << 20, dtype=torch.float32)  # 64 MiB: more than any socket buffer
    start = time.monotonic()
    with pytest.raises(DataPathError, match="broke while sending"):
        plane.send(3, 1, 5, [big], timeout=0.5)
    assert time.monotonic() - start < 5
    assert closed_by_peer(sock)
    # the worker's side: the same bound on a socket nobody reads
    listener = socket.create_server(("127.0.0.1", 0))
    out = socket.create_connection(listener.getsockname(), timeout=RPC_TIMEOUT)
    peer, _ = listener.accept()
    start = time.monotonic()
    with pytest.raises(dataconn.DataConnectionError, match="timed out"):
        dataconn.send_all(out, [dataconn.byte_view(big)], time.monotonic() + 0.5)
    assert time.monotonic() - start < 5
    for s in (out, peer, listener):
        s.close()


def test_send_all_and_call_records_count_bytes_whatever_the_views_item_size() -> None:
    """A memoryview of float32 items (4 bytes each) or of two dimensions is sent and counted in bytes,
    and a call's record announces the bytes of its body, not its items."""
    a, b = socket.socketpair()
    try:
        values = torch.arange(6, dtype=torch.float32)
        floats = memoryview(values.numpy())  # format "f": len() is 6 items, 24 bytes
        grid = memoryview(torch.arange(6, dtype=torch.uint8).numpy().reshape(2, 3))  # len() is 2 rows
        buffers = dataconn.call(7, [b"ab", floats, grid, b""], timeout=1.0)
        sent = dataconn.send_all(a, buffers, time.monotonic() + 5)
        assert sent == dataconn.RECORD.size + 2 + 24 + 6
        sequence, slot, _, nbytes = dataconn.recv_struct(b, dataconn.RECORD, time.monotonic() + 5)
        assert (sequence, slot, nbytes) == (7, dataconn.CALL, 32)
        body = bytearray(nbytes)
        dataconn.recv_exact(b, memoryview(body), time.monotonic() + 5)
        assert bytes(body) == b"ab" + values.numpy().tobytes() + bytes(range(6))
    finally:
        a.close()
        b.close()
