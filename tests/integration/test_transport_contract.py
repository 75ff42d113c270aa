"""One contract, both links (:mod:`ps_worker.transport.link`): a PushPull on gRPC and on the data
connection gives the same answers, the same refusals, the same answer to a push sent again, and
a PushPull abandoned mid-way changes nothing on the shard."""

from __future__ import annotations

import grpc
import pytest
import torch

from ps_worker import PSClient
from tests.conftest import RPC_TIMEOUT

LR = 0.1
SHAPES = {"once": 1 << 20, "frames": 1024}
"""partition_bytes: one message per shard (PushPullOnce), or several (PushPull stream and frames)."""


def model() -> torch.nn.Module:
    """MLP 8 -> 64 -> 4 (836 parameters, 3.3 KB: several 1 KiB partitions)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def params(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.data for k, p in m.named_parameters()}


def grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(p, 0.5) for k, p in m.named_parameters()}


def one_sgd_step(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach() - LR * 0.5 for k, p in m.named_parameters()}


@pytest.fixture(params=["grpc", "tcp"])
def data_path(request) -> str:
    return request.param


@pytest.fixture(params=list(SHAPES))
def shape(request) -> str:
    return request.param


@pytest.fixture
def connected(start_cluster, data_path: str, shape: str):
    """One shard offering a data connection, and an initialized client on ``data_path``."""
    cluster = start_cluster(num_shards=1, num_workers=1, data_port=0, metrics_port=-1)
    m = model()
    client = PSClient(
        cluster.addresses,
        0,
        1,
        incarnation=1,
        timeout=RPC_TIMEOUT,
        retry_deadline=1,
        partition_bytes=SHAPES[shape],
        data_path=data_path,
    )
    client.init(m, {"name": "sgd", "lr": LR})
    yield cluster, client, m
    client.close()


def on_its_link(client: PSClient, data_path: str) -> None:
    assert client.transport.data_connected == [data_path == "tcp"]


def test_a_push_pull_lands_once_and_brings_the_new_weights(connected, data_path: str) -> None:
    cluster, client, m = connected
    want = one_sgd_step(m)
    assert client.push_pull(grads(m), params(m)) == 1
    on_its_link(client, data_path)
    assert cluster[0].shard.version == 1
    for k, p in m.named_parameters():
        assert torch.equal(p.detach(), want[k]), k


def test_a_refused_push_has_the_same_code_and_changes_nothing(connected, data_path: str) -> None:
    cluster, client, m = connected
    before = {k: t.clone() for k, t in params(m).items()}
    with pytest.raises(grpc.RpcError) as info:
        client.push_pull(grads(m), params(m), [{"lr": float("nan")}])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "finite number" in info.value.details()
    assert cluster[0].shard.version == 0
    assert all(torch.equal(before[k], t) for k, t in params(m).items())
    assert client.push_pull(grads(m), params(m), []) == 1  # the link serves on
    on_its_link(client, data_path)


def test_a_push_sent_again_gets_the_recorded_answer(connected, data_path: str) -> None:
    cluster, client, m = connected
    want = one_sgd_step(m)
    assert client.push_pull(grads(m), params(m)) == 1
    s = client.session
    s.clock, s.versions, s.version = 0, [0], 0  # the same stamp again
    assert client.push_pull(grads(m), params(m)) == 1
    on_its_link(client, data_path)
    assert cluster[0].shard.version == 1  # applied once
    for k, p in m.named_parameters():
        assert torch.equal(p.detach(), want[k]), k


def test_an_abandoned_push_pull_changes_nothing(connected, data_path: str) -> None:
    cluster, client, m = connected
    want = one_sgd_step(m)
    pending = client.begin_push_pull(params(m), hyperparameters=[])
    first = next(iter(m.named_parameters()))
    pending.ready(first[0], torch.full_like(first[1], 0.5))  # one gradient of several, then abandoned
    pending.cancel()
    assert cluster[0].shard.version == 0
    assert client.push_pull(grads(m), params(m)) == 1  # the next push goes through
    assert cluster[0].shard.version == 1
    for k, p in m.named_parameters():
        assert torch.equal(p.detach(), want[k]), k
