"""Per-rank credentials (``ps-server --rank-tokens FILE``): a rank's token acts only as that rank,
on gRPC and on data connections, and a 2-worker job whose workers each send their own token trains.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from ps_common import dataconn
from ps_common.errors import reason_of
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_server.service.rank_tokens import RankTokens
from ps_worker import PSClient
from tests.conftest import RPC_TIMEOUT, small_model
from tests.helpers.data_connections import closed_by_peer, raw_connection
from tests.helpers.requests import once_request

TOKENS = {0: "rank-zero-token-0123456789", 1: "rank-one-token-0123456789"}
SHARED = "shared-worker-token"
ADMIN = "admin-token-secret"


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture
def two_ranks(start_cluster) -> Iterator[tuple]:
    """One async shard with rank tokens (and a shared token) and data connections; ranks 0 and 1
    joined and initialized, each with its own token."""
    cluster = start_cluster(
        num_shards=1,
        num_workers=2,
        mode="async",
        data_port=0,
        token=SHARED,
        admin_token=ADMIN,
        rank_tokens=RankTokens(TOKENS),
    )
    clients = [
        PSClient(cluster.addresses, rank=r, num_workers=2, incarnation=1, timeout=RPC_TIMEOUT, token=TOKENS[r])
        for r in (0, 1)
    ]
    models = [small_model() for _ in clients]
    for c, m in zip(clients, models, strict=True):
        c.init(m, {"name": "sgd", "lr": 0.1})
    yield cluster, clients, models
    for c in clients:
        c.close()


def refused_wrong_rank(call) -> str:
    """Run ``call``; it must fail PERMISSION_DENIED with reason WRONG_RANK. Returns the details."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
    assert reason_of(err.value) == "WRONG_RANK", err.value.details()
    return err.value.details()


def test_rank_1s_token_cannot_act_as_rank_0_on_grpc(two_ranks) -> None:
    cluster, (c0, c1), (m0, _) = two_ranks
    shard = cluster[0].shard
    before, incarnation0, session0 = shard.version, shard.members[0].incarnation, shard.members[0].session
    digest = shard.plan.digest
    with grpc.insecure_channel(cluster[0].address) as ch:
        stub = ps_pb2_grpc.ParameterServiceStub(ch)
        as_one = bearer(TOKENS[1])
        s0 = c0.session.sessions[0]
        calls = {
            "Join": lambda: stub.Join(
                ps_pb2.JoinRequest(rank=0, num_workers=2, incarnation=2**40), timeout=RPC_TIMEOUT, metadata=as_one
            ),
            "Heartbeat": lambda: stub.Heartbeat(
                ps_pb2.HeartbeatRequest(rank=0, incarnation=1), timeout=RPC_TIMEOUT, metadata=as_one
            ),
            "Leave": lambda: stub.Leave(
                ps_pb2.LeaveRequest(rank=0, incarnation=1), timeout=RPC_TIMEOUT, metadata=as_one
            ),
            "Pull": lambda: list(
                stub.Pull(
                    ps_pb2.PullRequest(rank=0, incarnation=1, plan_digest=digest), timeout=RPC_TIMEOUT, metadata=as_one
                )
            ),
            "PushPullOnce": lambda: stub.PushPullOnce(once_request(shard, 0, s0), timeout=RPC_TIMEOUT, metadata=as_one),
            "Push": lambda: stub.Push(
                iter([ps_pb2.PushRequest(header=once_request(shard, 0, s0).header)]),
                timeout=RPC_TIMEOUT,
                metadata=as_one,
            ),
            "PushRows": lambda: stub.PushRows(
                ps_pb2.PushRowsRequest(rank=0, incarnation=1, clock=0, session=s0), timeout=RPC_TIMEOUT, metadata=as_one
            ),
            "PullRows": lambda: stub.PullRows(
                ps_pb2.PullRowsRequest(rank=0, incarnation=1), timeout=RPC_TIMEOUT, metadata=as_one
            ),
            "InitTables": lambda: stub.InitTables(
                ps_pb2.InitTablesRequest(rank=0, incarnation=1), timeout=RPC_TIMEOUT, metadata=as_one
            ),
        }
        for name, call in calls.items():
            details = refused_wrong_rank(call)
            assert "token of rank 1" in details and "stamped rank 0" in details, (name, details)
        # the shared token may not act as a rank that has its own token either
        details = refused_wrong_rank(
            lambda: stub.Heartbeat(
                ps_pb2.HeartbeatRequest(rank=0, incarnation=1), timeout=RPC_TIMEOUT, metadata=bearer(SHARED)
            )
        )
        assert "shared worker token" in details
        # rank 1's token acts as rank 1; the admin token (the operator's) as any rank
        stub.Heartbeat(ps_pb2.HeartbeatRequest(rank=1, incarnation=1), timeout=RPC_TIMEOUT, metadata=as_one)
        stub.Heartbeat(ps_pb2.HeartbeatRequest(rank=0, incarnation=1), timeout=RPC_TIMEOUT, metadata=bearer(ADMIN))
    member = shard.members[0]
    assert (member.incarnation, member.session, shard.version) == (incarnation0, session0, before)  # nothing changed
    assert member.pushes == 0
    c0.push_pull(
        {k: torch.zeros_like(p) for k, p in m0.named_parameters()}, {k: p.data for k, p in m0.named_parameters()}
    )
    assert shard.version == before + 1 and shard.members[0].pushes == 1  # rank 0's own clock 0: applied


def test_a_data_connection_needs_its_hello_ranks_own_token(two_ranks) -> None:
    cluster, (c0, c1), _ = two_ranks
    port = cluster[0].data.port
    s0, s1 = c0.session.sessions[0], c1.session.sessions[0]
    # rank 1's token (or the shared one) in a hello of rank 0: closed, rank 0's connection kept
    assert closed_by_peer(raw_connection(port, rank=0, token=TOKENS[1], session=s0))
    assert closed_by_peer(raw_connection(port, rank=0, token=SHARED, session=s0))
    own = raw_connection(port, rank=1, token=TOKENS[1], session=s1)
    assert dataconn.recv_struct(own, dataconn.REPLY, time.monotonic() + RPC_TIMEOUT) == (dataconn.MAGIC, 0)
    own.close()


def test_two_workers_train_with_their_own_tokens(start_cluster) -> None:
    """A 2-shard, 2-worker sync job whose workers each send their rank's token trains to the end
    with both ranks' models equal."""
    cluster = start_cluster(
        num_shards=2, num_workers=2, mode="sync", data_port=0, admin_token=ADMIN, rank_tokens=RankTokens(TOKENS)
    )
    steps = 5
    finals: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def train(rank: int) -> None:
        try:
            model = small_model()
            with PSClient(cluster.addresses, rank=rank, num_workers=2, timeout=RPC_TIMEOUT, token=TOKENS[rank]) as c:
                c.init(model, {"name": "sgd", "lr": 0.1}, init_timeout=30)
                params = {k: p.data for k, p in model.named_parameters()}
                for _ in range(steps):
                    model.zero_grad()
                    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()
                    c.push_pull({k: p.grad for k, p in model.named_parameters()}, params)
                finals[rank] = {k: v.clone() for k, v in params.items()}
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert sorted(finals) == [0, 1]
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    assert [s.shard.version for s in cluster] == [steps, steps]
