"""The fast data path over real gRPC: PushPull equals Push + Pull bitwise, bf16/fp16 on the wire
halves the bytes the shard counts and keeps accuracy, top-k pushes k entries and converges."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ps_common import frames
from ps_worker.client import PSClient
from ps_worker.workloads.registry import get_workload
from ps_worker.workloads.train import train

RPC_TIMEOUT = 20.0
PUSH_PULL = "ps.v1.ParameterService/PushPullOnce"  # the digits model fits in one message


def counter(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def model(hidden: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))


def run_steps(
    addresses: list[str], steps: int, fused: bool, partition_bytes: int, hidden: int, **client_kw
) -> torch.Tensor:
    net = model(hidden)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 20, generator=gen), torch.randint(0, 3, (64,), generator=gen)
    with PSClient(
        addresses, 0, 1, incarnation=1, timeout=RPC_TIMEOUT, partition_bytes=partition_bytes, **client_kw
    ) as client:
        client.init(net, {"name": "sgd", "lr": 0.1, "momentum": 0.9})
        params = dict(net.named_parameters())
        for _ in range(steps):
            net.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            grads = {k: p.grad for k, p in params.items()}
            values = {k: p.data for k, p in params.items()}
            if fused:
                assert client.push_pull(grads, values) == client.clock
            else:
                client.push(grads)
                assert client.pull(values) == client.clock
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


@pytest.mark.parametrize(
    ("partition_bytes", "hidden"),
    [(1 << 20, 30), (1 << 20, 3000), (256, 30)],
    ids=["one-small-message", "one-large-message", "many-messages"],
)
def test_push_pull_is_push_then_pull_bitwise(start_cluster, partition_bytes: int, hidden: int) -> None:
    """One message each way (a unary call; small, or larger than the size up to which the answer
    is prepended) and many (a stream, partitions packed) give the parameters that a Push then a
    Pull give, bit for bit."""
    results = []
    for fused in (False, True):
        shards = start_cluster(2, num_workers=1)
        results.append(run_steps([s.address for s in shards], 5, fused, partition_bytes, hidden))
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float16"])
def test_narrow_wire_dtype_halves_the_shards_bytes_and_keeps_accuracy(start_cluster, wire_dtype: str) -> None:
    bytes_in, bytes_out, accuracy = {}, {}, {}
    for wire in (None, wire_dtype):
        (shard,) = start_cluster(1, num_workers=1)
        with PSClient([shard.address], 0, 1, timeout=RPC_TIMEOUT, wire_dtype=wire) as client:
            summary = train(
                get_workload("digits"), client, steps=150, batch_size=32, optimizer={"name": "sgd", "lr": 0.1}
            )
        bytes_in[wire] = counter(shard.metrics_url, "ps_received_bytes_total", method=PUSH_PULL)
        bytes_out[wire] = counter(shard.metrics_url, "ps_sent_bytes_total", method=PUSH_PULL)
        accuracy[wire] = summary.accuracy
    # 38,952 B of float32 parameters per step each way; the headers are a few hundred bytes
    assert 0.49 < bytes_in[wire_dtype] / bytes_in[None] < 0.52
    assert 0.49 < bytes_out[wire_dtype] / bytes_out[None] < 0.52
    assert abs(accuracy[wire_dtype] - accuracy[None]) <= 0.01, accuracy


def test_wire_dtype_must_be_narrower_than_the_parameters(start_cluster) -> None:
    (shard,) = start_cluster(1, num_workers=1)
    with PSClient([shard.address], 0, 1, timeout=RPC_TIMEOUT, wire_dtype="bfloat16") as client:
        with pytest.raises(ValueError, match="not narrower"):
            client.init(torch.nn.Linear(2, 2).to(torch.float16))
    with pytest.raises(ValueError, match="wire_dtype"):
        PSClient([shard.address], 0, 1, wire_dtype="int8")


def test_topk_pushes_k_entries_and_converges(start_cluster) -> None:
    summaries = {}
    for topk in (0.0, 0.1):
        (shard,) = start_cluster(1, num_workers=1)
        with PSClient([shard.address], 0, 1, timeout=RPC_TIMEOUT, topk=topk) as client:
            summaries[topk] = train(
                get_workload("digits"),
                client,
                steps=300,
                batch_size=32,
                optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
            )
    dense, sparse = summaries[0.0], summaries[0.1]
    # 10 % of the entries, each a 4-byte value and a 4-byte index: about a fifth of the bytes
    assert 0.19 * dense.pushed_bytes < sparse.pushed_bytes < 0.22 * dense.pushed_bytes
    assert sparse.pulled_bytes == dense.pulled_bytes  # pulls stay dense
    assert sparse.accuracy is not None and dense.accuracy is not None
    assert sparse.accuracy >= 0.93 and sparse.accuracy >= dense.accuracy - 0.03, (sparse.accuracy, dense.accuracy)


def test_push_pull_once_is_refused_when_the_shard_needs_more_than_one_message(start_cluster) -> None:
    (server,) = start_cluster(1, num_workers=1)
    net = model(30)
    with PSClient([server.address], 0, 1, incarnation=1, timeout=RPC_TIMEOUT, partition_bytes=256) as client:
        client.init(net)
        zeros = {k: torch.zeros(p.numel()) for k, p in net.named_parameters()}
        codec = client.path.codec
        head = frames.bytes_field(1, codec.push_header(client.session.stamp(0)))
        request = frames.build(codec.out_partitions(0, zeros, compress=False), head)
        with grpc.insecure_channel(server.address) as ch, pytest.raises(grpc.RpcError) as err:
            ch.unary_unary("/ps.v1.ParameterService/PushPullOnce")(request, timeout=RPC_TIMEOUT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "call PushPull" in err.value.details()
        assert server.shard.version == 0 and not server.shard.rounds.pending  # nothing changed
        params = dict(net.named_parameters())
        grads = {k: torch.ones_like(p) for k, p in params.items()}
        assert client.push_pull(grads, {k: p.data for k, p in params.items()}) == 1  # the stream form


class TwoHeads(torch.nn.Module):
    """An MLP with an unused head: its parameters get no gradient (zeros are pushed)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(20, 40), torch.nn.Tanh(), torch.nn.Linear(40, 40))
        self.head = torch.nn.Linear(40, 3)
        self.unused = torch.nn.Linear(40, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


@pytest.mark.parametrize("topk", [0.0, 0.3])
def test_pushes_overlapped_with_backward_give_the_same_parameters(start_cluster, topk: float) -> None:
    from ps_worker import DistributedOptimizer

    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 20, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    results = []
    for overlap in (False, True):
        shards = start_cluster(2, num_workers=1)
        net = TwoHeads()
        kw = {"incarnation": 1, "timeout": RPC_TIMEOUT, "partition_bytes": 512, "topk": topk}
        with PSClient([s.address for s in shards], 0, 1, **kw) as client:
            client.init(net, {"name": "sgd", "lr": 0.1, "momentum": 0.9})
            opt = DistributedOptimizer(net, client, overlap=overlap)
            for step in range(6):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
                assert opt.step() == step + 1
        results.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    assert torch.equal(results[0], results[1])
