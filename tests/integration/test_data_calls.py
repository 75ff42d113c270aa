"""A small model's PushPullOnce as a call on the data connection: the same bits, refusals (code,
details, ``ps-reason``), deadlines and metrics as the unary gRPC call, a fallback to gRPC when the
connection fails, and bounded, checked input on the shard's side."""

from __future__ import annotations

import socket
import time

import grpc
import pytest
import torch

from ps_common import dataconn
from ps_common.errors import reason_of
from ps_worker import PSClient
from ps_worker.transport.data_link import CODES, DataCallError
from ps_worker.workloads.train import params_sha256
from tests.conftest import RPC_TIMEOUT
from tests.helpers.data_connections import closed_by_peer, raw_connection
from tests.helpers.ranks import train_ranks

STEPS = 5
BATCH = 8
ONCE = "ps.v1.ParameterService/PushPullOnce"


def model() -> torch.nn.Module:
    """MLP 16 -> 32 -> 3 (643 parameters: one message per shard, so PushPullOnce)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def train(addresses: list[str], n: int, data_path: str, cut=None) -> tuple[list[torch.nn.Module], list[list[bool]]]:
    """``n`` worker threads, STEPS sync steps each (``cut(step)`` runs on rank 0 before each step)."""
    return train_ranks(
        addresses,
        n,
        model,
        STEPS,
        BATCH,
        {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        before_step=None if cut is None else lambda rank, t: cut(t) if rank == 0 else None,
        data_path=data_path,
    )


def once_calls(server, code: str = "OK") -> float:
    """``ps_rpc_duration_seconds_count{method=PushPullOnce, code}`` of a shard."""
    value = server.metrics.registry.get_sample_value("ps_rpc_duration_seconds_count", {"method": ONCE, "code": code})
    return value or 0.0


def test_calls_are_bitwise_the_grpc_call_and_counted_as_it(start_cluster) -> None:
    """2 workers x 2 shards, sync: every step is one call per shard on the data connections, with
    the same bits as the unary gRPC call, and the shards' metrics count them as PushPullOnce."""
    on = start_cluster(num_shards=2, num_workers=2, data_port=0)
    got, connected = train(on.addresses, 2, "tcp")
    assert connected == [[True, True], [True, True]]
    off = start_cluster(num_shards=2, num_workers=2, data_port=0)
    want, unused = train(off.addresses, 2, "grpc")
    assert unused == [[False, False], [False, False]]
    assert params_sha256(got[0]) == params_sha256(got[1]) == params_sha256(want[0])
    for k in range(2):
        assert on[k].data.calls == 2 * STEPS  # every step of both ranks: none went on gRPC
        assert off[k].data.calls == 0
        assert once_calls(on[k]) == once_calls(off[k]) == 2 * STEPS
        on_bytes, off_bytes = on[k].counters.view(), off[k].counters.view()
        assert on_bytes.received_bytes[ONCE] == off_bytes.received_bytes[ONCE] > 0
        assert on_bytes.sent_bytes[ONCE] == off_bytes.sent_bytes[ONCE] > 0


def test_a_lost_connection_falls_back_to_grpc_and_loses_nothing(start_cluster) -> None:
    """The shard's data plane stops between steps: the next step goes on gRPC, every round applied once."""
    cluster = start_cluster(num_shards=1, num_workers=1, data_port=0)

    def cut(step: int) -> None:
        if step == 2:
            cluster[0].data.close()

    got, connected = train(cluster.addresses, 1, "tcp", cut)
    assert connected == [[False]]
    assert cluster[0].shard.version == STEPS
    assert cluster[0].data.calls == 2
    reference = start_cluster(num_shards=1, num_workers=1)
    want, _ = train(reference.addresses, 1, "grpc")
    assert params_sha256(got[0]) == params_sha256(want[0])


def refusal(addresses: list[str], data_path: str, grads_of) -> grpc.RpcError:
    """The error of one push_pull of ``grads_of(model)`` by a fresh rank 0 of one worker."""
    m = model()
    with PSClient(addresses, 0, 1, incarnation=1, timeout=RPC_TIMEOUT, retry_deadline=1, data_path=data_path) as client:
        client.init(m, {"name": "sgd", "lr": 0.1})
        params = {k: p.data for k, p in m.named_parameters()}
        with pytest.raises(grpc.RpcError) as refused:
            client.push_pull(grads_of(m), params)
        assert client.transport.data_connected == [data_path == "tcp"]  # a refusal keeps the connection
    return refused.value


def test_a_refusal_has_the_grpc_calls_code_details_and_reason(start_cluster) -> None:
    """A non-finite gradient: INVALID_ARGUMENT with the same details and reason either way, nothing applied."""

    def nan(m: torch.nn.Module) -> dict[str, torch.Tensor]:
        grads = {k: torch.zeros_like(p) for k, p in m.named_parameters()}
        grads["2.weight"][1, 2] = float("nan")
        return grads

    errors = {}
    for path in ("tcp", "grpc"):
        cluster = start_cluster(num_shards=1, num_workers=1, data_port=0)
        errors[path] = refusal(cluster.addresses, path, nan)
        assert cluster[0].shard.version == 0
        assert cluster[0].data.calls == (1 if path == "tcp" else 0)
        assert once_calls(cluster[0], "INVALID_ARGUMENT") == 1
    tcp, grpc_ = errors["tcp"], errors["grpc"]
    assert tcp.code() is grpc_.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert tcp.details() == grpc_.details()
    assert reason_of(tcp) == reason_of(grpc_) != ""


def test_the_shards_deadline_ends_a_waiting_call(start_cluster) -> None:
    """Sync with 2 workers and only rank 0 pushing: the shard ends the call's wait before the
    worker's deadline, with the code and reason the gRPC call gets."""
    errors = {}
    for path in ("tcp", "grpc"):
        cluster = start_cluster(num_shards=1, num_workers=2, data_port=0)
        m = model()
        with PSClient(
            cluster.addresses, 0, 2, incarnation=1, timeout=2.0, retry_deadline=0.5, data_path=path
        ) as client:
            client.init(m, {"name": "sgd", "lr": 0.1})
            params = {k: p.data for k, p in m.named_parameters()}
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as waited:
                client.push_pull({k: torch.zeros_like(p) for k, p in params.items()}, params)
            assert time.monotonic() - start < RPC_TIMEOUT
        errors[path] = waited.value
    assert errors["tcp"].code() is errors["grpc"].code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert reason_of(errors["tcp"]) == reason_of(errors["grpc"])


# ---------------------------------------------------------------------- the shard's side, raw
def connected(port: int, rank: int = 0) -> socket.socket:
    """A raw data connection whose hello the shard accepted."""
    sock = raw_connection(port, rank)
    assert dataconn.recv_struct(sock, dataconn.REPLY, time.monotonic() + RPC_TIMEOUT) == (dataconn.MAGIC, 0)
    return sock


def answer(sock: socket.socket, sequence: int) -> tuple[grpc.StatusCode, bytes]:
    seq, slot, code, nbytes = dataconn.recv_struct(sock, dataconn.RECORD, time.monotonic() + RPC_TIMEOUT)
    assert (seq, slot) == (sequence, dataconn.CALL)
    body = bytearray(nbytes)
    dataconn.recv_exact(sock, memoryview(body), time.monotonic() + RPC_TIMEOUT)
    return CODES[code], bytes(body)


def test_a_malformed_call_is_refused_and_the_connection_serves_on(start_cluster) -> None:
    cluster = start_cluster(num_shards=1, num_workers=1, data_port=0)
    sock = connected(cluster[0].data.port)
    for sequence in (1, 2):  # the same connection answers again after a refusal
        sock.sendall(b"".join(dataconn.call(sequence, b"\xff\x00 not a frame", 5.0)))
        code, body = answer(sock, sequence)
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        reason, details = dataconn.parse_refusal(body)
        assert details
    assert cluster[0].shard.version == 0
    assert once_calls(cluster[0], "INVALID_ARGUMENT") == 2
    sock.close()


def test_a_call_over_the_message_limit_is_refused_before_its_bytes_are_read(start_cluster) -> None:
    cluster = start_cluster(num_shards=1, num_workers=1, data_port=0, max_message_bytes=8 << 20)
    sock = connected(cluster[0].data.port)
    sock.sendall(dataconn.RECORD.pack(9, dataconn.CALL, 5000, 1 << 40))  # 1 TiB announced, none sent
    code, body = answer(sock, 9)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit" in dataconn.parse_refusal(body)[1]
    assert closed_by_peer(sock)
    # the shard keeps serving, on a new data connection too
    got, connected_ = train(cluster.addresses, 1, "tcp")
    assert connected_ == [[True]] and cluster[0].shard.version == STEPS


def test_a_call_inside_a_frame_closes_the_connection(start_cluster) -> None:
    cluster = start_cluster(num_shards=1, num_workers=1, data_port=0)
    train(cluster.addresses, 1, "grpc")  # initialized: a frame's record is checked against the plan
    sock = connected(cluster[0].data.port)
    part = dataconn.RECORD.pack(3, 0, 1, 4 * 16 * 32)  # float32 partition 0 of frame 3 ...
    sock.sendall(part + bytes(4 * 16 * 32) + b"".join(dataconn.call(4, b"", 5.0)))  # ... then a call
    assert closed_by_peer(sock)
    assert cluster[0].data.calls == 0


def test_refusal_bodies_are_checked() -> None:
    assert dataconn.parse_refusal(dataconn.refusal("STALE", "too old")) == ("STALE", "too old")
    with pytest.raises(dataconn.DataConnectionError):
        dataconn.parse_refusal(b"\x01")
    with pytest.raises(dataconn.DataConnectionError):
        dataconn.parse_refusal(dataconn.STATUS.pack(99) + b"short")
    assert DataCallError(grpc.StatusCode.ABORTED, "d", "STALE").trailing_metadata() == (("ps-reason", "STALE"),)


def test_a_call_sent_as_buffers_announces_their_byte_count() -> None:
    floats = memoryview(torch.arange(3, dtype=torch.float32).numpy())  # 3 items of 4 bytes
    record, *chunks = dataconn.call(7, [b"ab", floats], 2.0)
    assert dataconn.RECORD.unpack(record) == (7, dataconn.CALL, 2000, 14)
    assert b"".join(bytes(c) for c in chunks) == b"ab" + bytes(floats)
    record, *chunks = dataconn.answer(7, 0, [b"", b"xyz"])
    assert dataconn.RECORD.unpack(record) == (7, dataconn.CALL, 0, 3)
    assert len(dataconn.buffer(5)) == 5 and not dataconn.buffer(5).readonly
