"""ps_server.server: a shard's threads start with it and end with ShardServer.stop()."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_server.config import ServerConfig
from ps_server.server import start_server
from ps_server.shard.shard import Shard
from ps_worker import PSClient
from tests.conftest import RPC_TIMEOUT, small_model


def owned_by_shard(thread: threading.Thread, k: int) -> bool:
    """Whether ``thread``'s name is one a shard ``k`` gives its threads."""
    name = thread.name
    return (
        name in (f"lease-reaper-{k}", f"checkpointer-{k}")
        or name.startswith(f"shard{k}_")
        or name.startswith(f"shard{k}-streams_")
    )


def test_stop_joins_every_thread_of_the_server(tmp_path, start_cluster) -> None:
    """Threads that were alive before (other tests' shards of the same index) are not counted."""
    before = set(threading.enumerate())
    (server,) = start_cluster(1, num_workers=1, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    try:
        with PSClient([server.address], rank=0, num_workers=1, timeout=RPC_TIMEOUT) as client:
            model = small_model()
            client.init(model, {"name": "sgd", "lr": 0.1})
            client.push({k: torch.ones_like(p) for k, p in model.named_parameters()})
        with grpc.insecure_channel(server.address) as channel:
            stream = ps_pb2_grpc.AdminStub(channel).WatchStatus(
                ps_pb2.WatchStatusRequest(interval_seconds=0.1), timeout=RPC_TIMEOUT
            )
            next(stream)  # a thread of the streams' pool is serving it
            started = {t.name for t in set(threading.enumerate()) - before if owned_by_shard(t, 0)}
            assert {"lease-reaper-0", "checkpointer-0"} <= started
            assert any(n.startswith("shard0_") for n in started) and any(
                n.startswith("shard0-streams_") for n in started
            )
            stream.cancel()
    finally:
        server.stop(grace=0.5)
    left = sorted(t.name for t in set(threading.enumerate()) - before if owned_by_shard(t, 0) and t.is_alive())
    assert left == []
    assert server.threads.join(0, "shard 0") == []
    assert server.checkpointer is not None and server.checkpointer.final_error is None
    assert server.metrics_endpoint is not None and not server.metrics_endpoint._thread.is_alive()


def test_a_given_shard_cannot_take_periodic_checkpoints(tmp_path) -> None:
    config = ServerConfig(
        shard_index=0, num_shards=1, num_workers=1, port=0, checkpoint_dir=str(tmp_path), checkpoint_every=5
    )
    shard = Shard(0, 1, config.mode_settings())
    with pytest.raises(ValueError, match="pass shard=None, or checkpoint_every=0"):
        start_server(config, shard)
