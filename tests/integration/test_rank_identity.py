"""A worker pushes only as the rank it joined as, on gRPC and on data connections.

Every Join draws a session (``JoinResponse.session``) that each push-type request of the rank must
carry, and a data connection carries only its hello's rank: a push stamped with another rank is
refused and changes nothing, so the rank's own push of that clock is applied, not answered as a
duplicate.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from ps_common import dataconn
from ps_common.errors import reason_of
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_server.membership.ranks import WorkerState
from ps_worker import PSClient
from ps_worker.transport.data_link import CODES
from tests.conftest import RPC_TIMEOUT, small_model
from tests.helpers.data_connections import closed_by_peer, raw_connection
from tests.helpers.requests import once_request


@pytest.fixture
def two_ranks(start_cluster) -> Iterator[tuple]:
    """One async shard with data connections and two joined, initialized ranks."""
    cluster = start_cluster(num_shards=1, num_workers=2, mode="async", data_port=0, token="tok")
    clients = [
        PSClient(cluster.addresses, rank=r, num_workers=2, incarnation=1, timeout=RPC_TIMEOUT, token="tok")
        for r in (0, 1)
    ]
    models = [small_model() for _ in clients]
    for c, m in zip(clients, models, strict=True):
        c.init(m, {"name": "sgd", "lr": 0.1})
    yield cluster, clients, models
    for c in clients:
        c.close()


def step(client: PSClient, model: torch.nn.Module) -> None:
    client.push_pull(
        {k: torch.zeros_like(p) for k, p in model.named_parameters()}, {k: p.data for k, p in model.named_parameters()}
    )


def test_a_grpc_push_stamped_with_another_rank_is_refused_and_that_ranks_push_is_applied(two_ranks) -> None:
    cluster, (c0, c1), (m0, _) = two_ranks
    shard = cluster[0].shard
    before = shard.version
    with grpc.insecure_channel(cluster[0].address) as ch:
        stub = ps_pb2_grpc.ParameterServiceStub(ch)
        metadata = (("authorization", "Bearer tok"),)
        forged = once_request(shard, rank=0, session=c1.session.sessions[0])  # rank 1's session, stamped rank 0
        with pytest.raises(grpc.RpcError) as err:
            stub.PushPullOnce(forged, timeout=RPC_TIMEOUT, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and reason_of(err.value) == "WRONG_RANK"
        assert "session of rank 1" in err.value.details()
        for session in (0, 12345):  # none, or a stale one: join again
            with pytest.raises(grpc.RpcError) as err:
                stub.PushPullOnce(once_request(shard, 0, session), timeout=RPC_TIMEOUT, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and reason_of(err.value) == "NOT_JOINED"
            assert "Join again" in err.value.details()
        rows = ps_pb2.PushRowsRequest(rank=0, incarnation=1, clock=0, session=c1.session.sessions[0])
        with pytest.raises(grpc.RpcError) as err:
            stub.PushRows(rows, timeout=RPC_TIMEOUT, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert shard.version == before and shard.members[0].pushes == 0  # nothing applied
    step(c0, m0)  # rank 0's own clock 0: applied, not answered as a duplicate
    assert shard.version == before + 1 and shard.members[0].pushes == 1


def call(sock, sequence: int, request: ps_pb2.PushPullOnceRequest) -> tuple[grpc.StatusCode, str]:
    sock.sendall(b"".join(dataconn.call(sequence, request.SerializeToString(), 5.0)))
    seq, slot, code, nbytes = dataconn.recv_struct(sock, dataconn.RECORD, time.monotonic() + RPC_TIMEOUT)
    assert (seq, slot) == (sequence, dataconn.CALL)
    body = bytearray(nbytes)
    dataconn.recv_exact(sock, memoryview(body), time.monotonic() + RPC_TIMEOUT)
    return CODES[code], dataconn.parse_refusal(bytes(body))[1] if code else ""


def test_a_data_connection_carries_only_its_hellos_rank(two_ranks) -> None:
    cluster, (c0, c1), (m0, _) = two_ranks
    shard, port = cluster[0].shard, cluster[0].data.port
    before = shard.version
    sock = raw_connection(port, rank=1, token="tok", session=c1.session.sessions[0])  # rank 1's own hello
    assert dataconn.recv_struct(sock, dataconn.REPLY, time.monotonic() + RPC_TIMEOUT) == (dataconn.MAGIC, 0)
    # stamped rank 0, even with rank 0's own session: refused at its first record, the connection serves on
    code, details = call(sock, 1, once_request(shard, rank=0, session=c0.session.sessions[0]))
    assert code is grpc.StatusCode.PERMISSION_DENIED and "data connection of rank 1" in details
    code, details = call(sock, 2, once_request(shard, rank=1, session=c0.session.sessions[0]))
    assert code is grpc.StatusCode.PERMISSION_DENIED and "session of rank 0" in details
    sock.close()
    assert shard.version == before and shard.members[0].pushes == 0
    step(c0, m0)
    assert shard.version == before + 1 and shard.members[0].pushes == 1
    assert c0.transport.data_connected == [True]
    # a hello of rank 0 without its session neither replaces rank 0's connection nor gets a frame taken
    assert closed_by_peer(raw_connection(port, rank=0, token="tok", session=999))
    other = raw_connection(port, rank=1, token="tok", session=999)  # rank 1 has no connection now
    assert dataconn.recv_struct(other, dataconn.REPLY, time.monotonic() + RPC_TIMEOUT) == (dataconn.MAGIC, 0)
    other.sendall(dataconn.RECORD.pack(1, 0, ps_pb2.DTYPE_FLOAT32, 4))  # its first record: refused
    assert closed_by_peer(other)
    step(c0, m0)
    assert c0.transport.data_connected == [True] and shard.version == before + 2


def test_a_live_rank_leaves_only_with_its_own_session(two_ranks) -> None:
    """A Leave of live rank 1 without its session, or with rank 0's, is refused and rank 1 stays
    counted; the rank's own close (which carries its session) leaves."""
    cluster, (c0, c1), _ = two_ranks
    shard = cluster[0].shard
    with grpc.insecure_channel(cluster[0].address) as ch:
        stub = ps_pb2_grpc.ParameterServiceStub(ch)
        metadata = (("authorization", "Bearer tok"),)
        incarnation = c1.session.incarnation
        for session, code in ((0, "FAILED_PRECONDITION"), (c0.session.sessions[0], "PERMISSION_DENIED")):
            with pytest.raises(grpc.RpcError) as err:
                stub.Leave(
                    ps_pb2.LeaveRequest(rank=1, incarnation=incarnation, session=session),
                    timeout=RPC_TIMEOUT,
                    metadata=metadata,
                )
            assert err.value.code().name == code, err.value.details()
    assert shard.members[1].state is WorkerState.LIVE and shard.members[1].counted
    c1.close()
    assert shard.members[1].state is WorkerState.LEFT
