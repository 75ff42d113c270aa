"""Shared fixtures: in-process shards on 127.0.0.1:0 and small models."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import settings

from ps_server.config import ServerConfig
from ps_server.server import ShardServer, start_server

# Property tests check behaviour, not speed: a loaded 2-core CI machine must not fail them on time.
settings.register_profile("grpc-ps", deadline=None)
settings.load_profile("grpc-ps")

RPC_TIMEOUT = 10.0
"""Seconds every RPC in a test may take; a barrier bug fails instead of hanging."""


@pytest.fixture
def start_cluster() -> Iterator[Callable[..., list[ShardServer]]]:
    """Factory: ``start_cluster(num_shards, num_workers, **config)`` -> running shards; all stopped after."""
    started: list[ShardServer] = []

    def start(num_shards: int = 2, num_workers: int = 2, **kwargs: object) -> list[ShardServer]:
        shards = [
            start_server(ServerConfig(shard_index=k, num_shards=num_shards, num_workers=num_workers, port=0, **kwargs))
            for k in range(num_shards)
        ]
        started.extend(shards)
        return shards

    yield start
    for s in started:
        s.stop(grace=0.5)


def small_model(seed: int = 0) -> torch.nn.Module:
    """MLP 8 -> 16 -> 3 (195 parameters), seeded."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
