"""ps_worker.transport.encoding: the worker's requests are the bytes protobuf would write, and responses decode
into the plan's tensors (no sockets)."""

from __future__ import annotations

import pytest
import torch

from ps_common import frames
from ps_common.codec import dtype_to_proto
from ps_common.plan import make_plan
from ps_common.wire import optimizer_to_proto, plan_to_proto, with_partition
from ps_proto.v1 import ps_pb2
from ps_worker.compression import TopK
from ps_worker.planning import model_plan, model_specs
from ps_worker.transport.encoding import Stamp, WireCodec
from ps_worker.workloads.digits import DigitsWorkload


def digits(num_shards: int = 2, partition_bytes: int = 4096):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(64), DigitsWorkload().model())
    named, opt, plan = model_plan(model, {"name": "sgd", "lr": 0.1, "momentum": 0.9}, True, num_shards, partition_bytes)
    return model, named, opt, plan


def protobuf_init(plan, k: int, opt, named, rank: int, incarnation: int) -> list[bytes]:
    """Shard ``k``'s Init stream as protobuf messages would serialize it."""
    header = ps_pb2.InitHeader(
        rank=rank, incarnation=incarnation, plan=plan_to_proto(plan), optimizer=optimizer_to_proto(opt)
    )
    values = {key: t.detach().to(torch.float64 if not t.is_floating_point() else t.dtype) for key, t in named}
    out = [ps_pb2.InitRequest(header=header).SerializeToString(deterministic=True)]
    for part in plan.owned_by(k):
        flat = values[part.key].reshape(-1)[part.offset : part.offset + part.length].contiguous()
        data = flat.view(torch.uint8).numpy().tobytes()
        msg = with_partition(
            ps_pb2.InitRequest(), part.key, part.offset, part.length, dtype_to_proto(plan.dtypes[part.key]), data
        )
        out.append(msg.SerializeToString(deterministic=True))
    return out


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_init_requests_of_a_real_model_are_the_bytes_protobuf_writes_both_ways(num_shards: int) -> None:
    _, named, opt, plan = digits(num_shards)
    codec = WireCodec(plan)
    assert any(not t.is_floating_point() for _, t in named)  # an integer buffer, sent as float64
    for k in range(num_shards):
        built = codec.init_messages(k, 1, 123456789, opt, dict(named))
        assert built == protobuf_init(plan, k, opt, named, 1, 123456789)
        parsed = [ps_pb2.InitRequest.FromString(m) for m in built]
        assert parsed[0].header.plan == plan_to_proto(plan) and parsed[0].header.incarnation == 123456789
        assert [(m.partition.key, m.partition.offset, m.partition.length) for m in parsed[1:]] == [
            (p.key, p.offset, p.length) for p in plan.owned_by(k)
        ]


def test_an_init_at_a_version_says_it_in_its_header() -> None:
    _, named, opt, plan = digits(1)
    head = WireCodec(plan).init_messages(0, 0, 1, opt, dict(named), 0, version=9)[0]
    assert ps_pb2.InitRequest.FromString(head).header.version == 9


def test_push_exchange_and_pull_requests_are_protobuf() -> None:
    _, named, _, plan = digits(2)
    codec = WireCodec(plan, "bfloat16")
    stamp = Stamp(rank=1, incarnation=7, clock=3, version=2, hyperparameters=[{"lr": 0.05}], skip=True)
    header = ps_pb2.PushHeader(
        rank=1,
        incarnation=7,
        clock=3,
        version=2,
        plan_digest=plan.digest,
        groups=[ps_pb2.GroupHyperparameters(values={"lr": 0.05})],
        skip=True,
    )
    assert codec.push_head(stamp) == ps_pb2.PushRequest(header=header).SerializeToString(deterministic=True)
    assert codec.push_pull_head(stamp) == ps_pb2.PushPullRequest(
        header=header, wire_dtype=ps_pb2.DTYPE_BFLOAT16
    ).SerializeToString(deterministic=True)
    assert ps_pb2.PullRequest.FromString(codec.pull_request(1, 7, 5).SerializeToString()).wire_dtype == (
        ps_pb2.DTYPE_BFLOAT16
    )
    flats = {key: t.detach().to(torch.float32).reshape(-1) for key, t in named}
    msgs = codec.exchange_messages(0, 1, 7, 4, flats)
    expected = ps_pb2.ExchangeHeader(rank=1, incarnation=7, clock=4, plan_digest=plan.digest)
    assert msgs[0] == ps_pb2.ExchangeRequest(header=expected).SerializeToString(deterministic=True)
    assert [ps_pb2.ExchangeRequest.FromString(m).partition.dtype for m in msgs[1:]] == [ps_pb2.DTYPE_BFLOAT16] * (
        len(plan.owned_by(0))
    )


def test_a_wire_dtype_wider_than_a_parameter_is_refused() -> None:
    plan = make_plan(model_specs([("w", torch.zeros(3, dtype=torch.float16))]), 1)
    with pytest.raises(ValueError, match="not narrower"):
        WireCodec(plan, "float32")


def test_decode_copies_each_partition_into_place_and_returns_the_answer() -> None:
    _, named, _, plan = digits(2, partition_bytes=1024)
    codec = WireCodec(plan)
    source = {
        key: torch.randn(t.numel(), dtype=torch.float64 if not t.is_floating_point() else t.dtype) for key, t in named
    }
    into = {key: torch.zeros_like(t) for key, t in source.items()}
    answer = ps_pb2.PushResponse(version=4, staleness=1)
    for k in range(2):
        outs = [
            frames.OutPartition(p.key, p.offset, p.length, source[p.key][p.offset : p.offset + p.length])
            for p in plan.owned_by(k)
        ]
        answer_field = frames.bytes_field(3, answer.SerializeToString())  # after the partitions
        replies = [frames.build(outs[:1], frames.uint_field(1, 5)) + answer_field]
        replies += [frames.build([o], frames.uint_field(1, 5)) for o in outs[1:]]
        sizes: list[int] = []
        version, received, got = codec.decode(k, replies, into, "h:1", sizes.append)
        assert version == 5 and got == answer and sizes == [len(r) for r in replies]
        assert received == sum(o.values.numel() * o.values.element_size() for o in outs)
    assert all(torch.equal(into[key], source[key]) for key in source)


def test_decode_refuses_partitions_outside_the_plan_and_missing_ones() -> None:
    _, named, _, plan = digits(1)
    codec = WireCodec(plan)
    into = {
        key: torch.zeros(t.numel(), dtype=torch.float64 if not t.is_floating_point() else t.dtype) for key, t in named
    }
    first = plan.owned_by(0)[0]
    wrong = frames.OutPartition(first.key, first.offset, first.length + 1, torch.zeros(first.length + 1))
    with pytest.raises(RuntimeError, match="outside the plan"):
        codec.decode(0, [frames.build([wrong])], into, "h:1")
    good = frames.OutPartition(first.key, first.offset, first.length, torch.zeros(first.length))
    with pytest.raises(RuntimeError, match=f"sent 1 of {len(plan.owned_by(0))} partitions"):
        codec.decode(0, [frames.build([good])], into, "h:1")


def test_top_k_gradients_go_sparse_and_pack_into_fewer_messages() -> None:
    _, named, _, plan = digits(1, partition_bytes=2048)
    dense, sparse = WireCodec(plan), WireCodec(plan, compressor=TopK(0.1))
    assert len(sparse.request_groups[0]) < len(dense.request_groups[0])
    flats = {key: torch.randn(t.numel()) for key, t in named}
    part = plan.owned_by(0)[0]
    out = sparse.to_wire(part, flats[part.key], compress=True)
    assert out.indices is not None and out.values.numel() == TopK(0.1).k(part.length)
    assert sparse.to_wire(part, flats[part.key], compress=False).indices is None
