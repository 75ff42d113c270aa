"""Bad input over real gRPC: the right status code, a message saying what to do, state unchanged."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch

from ps_common.wire import plan_to_proto
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_worker import PSClient
from tests.conftest import RPC_TIMEOUT, small_model
from tests.helpers.tensors import encode


@pytest.fixture
def live(start_cluster):
    """One initialized shard (2 workers), rank 0 joined through PSClient; yields (shard, stub, client)."""
    (shard,) = start_cluster(num_shards=1, num_workers=2)
    client = PSClient([shard.address], rank=0, num_workers=2, incarnation=1, timeout=RPC_TIMEOUT)
    client.init(small_model(), {"name": "sgd", "lr": 0.1})
    channel = grpc.insecure_channel(shard.address)
    yield shard, ps_pb2_grpc.ParameterServiceStub(channel), client
    channel.close()
    client.close()


def good_partitions(client: PSClient) -> list[ps_pb2.Partition]:
    return [
        ps_pb2.Partition(
            key=p.key, offset=p.offset, length=p.length, dtype=ps_pb2.DTYPE_FLOAT32, data=encode(torch.ones(p.length))
        )
        for p in client.plan.owned_by(0)
    ]


def push_stream(client: PSClient, parts: list[ps_pb2.Partition], **header: object) -> Iterator[ps_pb2.PushRequest]:
    fields = {
        "rank": 0,
        "incarnation": 1,
        "clock": 0,
        "version": 0,
        "plan_digest": client.plan.digest,
        "session": client.session.sessions[0],  # the joined client's: the push is refused for its content
        **header,
    }
    yield ps_pb2.PushRequest(header=ps_pb2.PushHeader(**fields))
    for p in parts:
        yield ps_pb2.PushRequest(partition=p)


def snapshot(shard, client: PSClient) -> tuple:
    status = shard.shard.status()
    params = {k: torch.zeros(s) for k, s in ((s.key, s.shape) for s in client.plan.specs)}
    client.pull(params, min_version=0)
    return status.version, status.round_ranks, [(w.clock, w.pushes) for w in status.workers], params


def edit(parts: list[ps_pb2.Partition], **fields: object) -> list[ps_pb2.Partition]:
    first = ps_pb2.Partition()
    first.CopyFrom(parts[0])
    for k, v in fields.items():
        setattr(first, k, v)
    return [first, *parts[1:]]


CASES = {
    "unknown key": (
        lambda parts: edit(parts, key="fc9.weight"),
        {},
        grpc.StatusCode.INVALID_ARGUMENT,
        "Unknown parameter 'fc9.weight'",
    ),
    "wrong length": (
        lambda parts: edit(parts, length=parts[0].length - 1),
        {},
        grpc.StatusCode.INVALID_ARGUMENT,
        "not one this shard",
    ),
    "wrong byte count": (
        lambda parts: edit(parts, data=parts[0].data[:-4]),
        {},
        grpc.StatusCode.INVALID_ARGUMENT,
        "bytes",
    ),
    "wrong dtype": (
        lambda parts: edit(parts, dtype=ps_pb2.DTYPE_FLOAT64),
        {},
        grpc.StatusCode.INVALID_ARGUMENT,
        "dtype",
    ),
    "unspecified dtype": (
        lambda parts: edit(parts, dtype=ps_pb2.DTYPE_UNSPECIFIED),
        {},
        grpc.StatusCode.INVALID_ARGUMENT,
        "unspecified",
    ),
    "non-finite": (
        lambda parts: edit(parts, data=encode(torch.full((parts[0].length,), float("inf")))),
        {},
        grpc.StatusCode.INVALID_ARGUMENT,
        "NaN or infinity",
    ),
    "missing partition": (lambda parts: parts[1:], {}, grpc.StatusCode.INVALID_ARGUMENT, "misses 1"),
    "mismatched plan": (
        lambda parts: parts,
        {"plan_digest": "0" * 64},
        grpc.StatusCode.FAILED_PRECONDITION,
        "every worker must build the same model",
    ),
    "rank >= num_workers": (lambda parts: parts, {"rank": 2}, grpc.StatusCode.INVALID_ARGUMENT, "num_workers=2"),
    "future round": (lambda parts: parts, {"clock": 9}, grpc.StatusCode.FAILED_PRECONDITION, "pull version 9"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_push_is_refused_and_changes_nothing(live, case: str) -> None:
    shard, stub, client = live
    mutate, header, code, message = CASES[case]
    before = snapshot(shard, client)
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(push_stream(client, mutate(good_partitions(client)), **header), timeout=RPC_TIMEOUT)
    assert err.value.code() == code, err.value.details()
    assert message in err.value.details()
    after = snapshot(shard, client)
    assert after[:3] == before[:3]
    assert all(torch.equal(after[3][k], before[3][k]) for k in before[3])
    # the shard keeps serving: a good push is accepted afterwards
    reply = stub.Push(push_stream(client, good_partitions(client)), timeout=RPC_TIMEOUT)
    assert reply.version == 0 and not reply.duplicate


def test_stream_without_header_is_refused(live) -> None:
    _, stub, client = live
    parts = good_partitions(client)
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(iter([ps_pb2.PushRequest(partition=parts[0])]), timeout=RPC_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "start with a header" in err.value.details()


def test_push_and_pull_before_init_fail_precondition(start_cluster) -> None:
    (shard,) = start_cluster(num_shards=1, num_workers=1)
    with grpc.insecure_channel(shard.address) as channel:
        stub = ps_pb2_grpc.ParameterServiceStub(channel)
        header = ps_pb2.PushHeader(rank=0, incarnation=1, clock=0)
        with pytest.raises(grpc.RpcError) as err:
            stub.Push(iter([ps_pb2.PushRequest(header=header)]), timeout=RPC_TIMEOUT)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "rank 0 must call Init" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Pull(ps_pb2.PullRequest(rank=0), timeout=RPC_TIMEOUT))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_init_with_another_plan_is_refused(live) -> None:
    shard, stub, client = live
    other = PSClient([shard.address], rank=1, num_workers=2, incarnation=1, timeout=RPC_TIMEOUT)
    try:
        big = torch.nn.Linear(8, 9)
        from ps_common.plan import make_plan
        from ps_worker.client import model_specs

        plan = make_plan(model_specs(list(big.named_parameters())), 1)
        header = ps_pb2.InitHeader(
            rank=1,
            incarnation=1,
            plan=plan_to_proto(plan),
            optimizer=ps_pb2.OptimizerSpec(name="sgd", kwargs={"lr": 0.1}),
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.Init(iter([ps_pb2.InitRequest(header=header)]), timeout=RPC_TIMEOUT)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "does not match" in err.value.details()
        with pytest.raises(RuntimeError, match="every worker must build the same model"):
            other.init(big, init_timeout=5)
    finally:
        other.close()


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [({"name": "pickle", "lr": 0.1}, "Unknown optimizer"), ({"name": "sgd", "lr": float("inf")}, "finite")],
)
def test_bad_optimizer_spec_is_refused_before_anything_is_sent(start_cluster, optimizer, message) -> None:
    from ps_common.errors import InvalidRequestError

    (shard,) = start_cluster(num_shards=1, num_workers=1)
    with PSClient([shard.address], rank=0, num_workers=1, timeout=RPC_TIMEOUT) as client:
        with pytest.raises(InvalidRequestError, match=message):
            client.init(small_model(), optimizer)
    assert not shard.shard.status().initialized


def test_bad_optimizer_on_the_wire_is_invalid_argument(start_cluster) -> None:
    (shard,) = start_cluster(num_shards=1, num_workers=1)
    model = small_model()
    from ps_common.plan import make_plan
    from ps_worker.client import model_specs

    plan = make_plan(model_specs(list(model.named_parameters())), 1)
    header = ps_pb2.InitHeader(
        rank=0, incarnation=1, plan=plan_to_proto(plan), optimizer=ps_pb2.OptimizerSpec(name="sgd", kwargs={"lr": -1})
    )
    with grpc.insecure_channel(shard.address) as channel:
        stub = ps_pb2_grpc.ParameterServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Init(iter([ps_pb2.InitRequest(header=header)]), timeout=RPC_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lr" in err.value.details()
    assert not shard.shard.status().initialized
    assert shard.counters.rejected == 1


def test_join_with_wrong_worker_count_is_invalid_argument(start_cluster) -> None:
    (shard,) = start_cluster(num_shards=1, num_workers=2)
    with PSClient([shard.address], rank=0, num_workers=3, timeout=RPC_TIMEOUT) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.join()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "same --num-workers" in err.value.details()
