"""A model whose largest parameter is 64 MiB trains through 2 shards without a message-size error."""

from __future__ import annotations

import torch

from ps_worker import DistributedOptimizer, PSClient
from tests.conftest import RPC_TIMEOUT


def test_64_mib_parameter_trains_through_two_shards(start_cluster) -> None:
    shards = start_cluster(num_shards=2, num_workers=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096)  # weight: 16.8M float32 = 64 MiB
    assert model.weight.numel() * 4 == 64 * 1024 * 1024
    with PSClient([s.address for s in shards], rank=0, num_workers=1, timeout=RPC_TIMEOUT * 6) as client:
        client.init(model, {"name": "sgd", "lr": 0.01})
        opt = DistributedOptimizer(model, client)
        x = torch.randn(4, 4096)
        before = model.weight.detach().clone()
        for _ in range(2):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        assert client.version == 2
        assert not torch.equal(model.weight, before)
        assert client.pushed_bytes >= 2 * (64 * 1024 * 1024)
    owned = [s.shard.status().parameter_bytes for s in shards]
    assert sum(owned) == (4096 * 4096 + 4096) * 4
    assert min(owned) > 30 * 1024 * 1024  # both shards hold about half


def test_a_shard_that_owns_nothing_still_serves(start_cluster) -> None:
    """A model of fewer elements than shards (one weight over 2 shards) leaves shard 1 empty; training still works."""
    shards = start_cluster(num_shards=2, num_workers=1)
    model = torch.nn.Linear(1, 1, bias=False)
    with PSClient([s.address for s in shards], rank=0, num_workers=1, timeout=RPC_TIMEOUT) as client:
        client.init(model, {"name": "adam", "lr": 0.01})
        opt = DistributedOptimizer(model, client)
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(2, 1)).sum().backward()
            opt.step()
        assert client.versions == [3, 3]
    assert shards[1].shard.status().num_partitions == 0
