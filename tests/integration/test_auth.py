"""Tokens: no token is UNAUTHENTICATED, the worker token on Admin is PERMISSION_DENIED; health stays open."""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_worker import PSClient
from tests.conftest import RPC_TIMEOUT, small_model


@pytest.fixture
def secured(start_cluster):
    (shard,) = start_cluster(num_shards=1, num_workers=1, token="worker-secret", admin_token="admin-secret")
    channel = grpc.insecure_channel(shard.address)
    yield shard, channel
    channel.close()


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def test_missing_or_wrong_token_is_unauthenticated(secured) -> None:
    _, channel = secured
    stub = ps_pb2_grpc.ParameterServiceStub(channel)
    req = ps_pb2.JoinRequest(rank=0, num_workers=1, incarnation=1)
    for metadata in ((), bearer("guess")):
        with pytest.raises(grpc.RpcError) as err:
            stub.Join(req, timeout=RPC_TIMEOUT, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "PS_TOKEN" in err.value.details()
    assert stub.Join(req, timeout=RPC_TIMEOUT, metadata=bearer("worker-secret")).num_shards == 1


@pytest.mark.parametrize("header", ["bearer worker-secret", "BEARER worker-secret", "Bearer   worker-secret"])
def test_the_bearer_scheme_is_case_insensitive(secured, header: str) -> None:
    """RFC 6750 section 2.1: the scheme's name is case-insensitive (RFC 9110 section 11.1)."""
    _, channel = secured
    stub = ps_pb2_grpc.ParameterServiceStub(channel)
    req = ps_pb2.JoinRequest(rank=0, num_workers=1, incarnation=1)
    assert stub.Join(req, timeout=RPC_TIMEOUT, metadata=(("authorization", header),)).num_shards == 1
    for wrong in ("Basic worker-secret", "Bearerworker-secret", "bearer worker-secret2"):
        with pytest.raises(grpc.RpcError) as err:
            stub.Join(req, timeout=RPC_TIMEOUT, metadata=(("authorization", wrong),))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_worker_token_on_admin_is_permission_denied(secured) -> None:
    _, channel = secured
    admin = ps_pb2_grpc.AdminStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        admin.GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT, metadata=bearer("worker-secret"))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as err:
        admin.GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    status = admin.GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT, metadata=bearer("admin-secret"))
    assert status.status.num_shards == 1


def test_health_stays_open_and_streams_are_guarded(secured) -> None:
    shard, channel = secured
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service="ps.v1.ParameterService"), timeout=RPC_TIMEOUT)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = ps_pb2_grpc.ParameterServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Pull(ps_pb2.PullRequest(rank=0), timeout=RPC_TIMEOUT))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(iter([ps_pb2.PushRequest(header=ps_pb2.PushHeader())]), timeout=RPC_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert shard.counters.rejected == 2


def test_client_with_token_trains(secured) -> None:
    shard, _ = secured
    with PSClient([shard.address], rank=0, num_workers=1, token="worker-secret", timeout=RPC_TIMEOUT) as client:
        model = small_model()
        client.init(model, {"name": "sgd", "lr": 0.1})
        model(__import__("torch").randn(2, 8)).sum().backward()
        client.push({k: p.grad for k, p in model.named_parameters()})
        assert client.pull({k: p.data for k, p in model.named_parameters()}) == 1


def test_a_shard_with_a_worker_token_and_no_admin_token_warns_that_admin_is_open(start_cluster, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="ps_server.server"):
        start_cluster(1, num_workers=1, token="worker-only")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("PS_ADMIN_TOKEN" in w and "without a token" in w for w in warnings), warnings
