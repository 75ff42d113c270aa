"""Checkpoints wired into shards: periodic at the same versions on every sync shard, on stop, on
demand (Admin/Checkpoint); a restarted shard resumes exactly and says so."""

from __future__ import annotations

import grpc
import pytest
import torch

from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_server.checkpoint import CheckpointStore
from ps_server.config import ServerConfig
from ps_server.server import start_server
from ps_worker import DistributedOptimizer, PSClient
from tests.conftest import RPC_TIMEOUT, small_model


def train(addresses: list[str], steps: int, incarnation: int = 1) -> torch.nn.Module:
    model = small_model()
    g = torch.Generator().manual_seed(3)
    with PSClient(addresses, rank=0, num_workers=1, incarnation=incarnation, timeout=RPC_TIMEOUT) as c:
        c.init(model, {"name": "adam", "lr": 0.01})
        opt = DistributedOptimizer(model, c)
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
            opt.step()
    return model


def test_sync_shards_checkpoint_the_same_versions_and_resume_exactly(tmp_path) -> None:
    configs = [
        ServerConfig(
            shard_index=k,
            num_shards=2,
            num_workers=1,
            port=0,
            checkpoint_dir=str(tmp_path),
            checkpoint_every=5,
            checkpoint_keep=2,
        )
        for k in range(2)
    ]
    shards = [start_server(c) for c in configs]
    try:
        train([s.address for s in shards], steps=12)
        states = [s.shard.export_state() for s in shards]
    finally:
        for s in shards:
            s.stop(grace=0.5)  # writes a final checkpoint at version 12
    versions = [[c.version for c in CheckpointStore(tmp_path, k).checkpoints()] for k in range(2)]
    assert versions == [[10, 12], [10, 12]]  # every 5 versions, the same on both shards; keep 2

    restarted = [start_server(c) for c in configs]
    try:
        for before, s in zip(states, restarted, strict=True):
            view = s.shard.status()
            assert view.restored_from_version == 12 and view.version == 12
            after = s.shard.export_state()
            assert all(torch.equal(a, b) for a, b in zip(before["tensors"], after["tensors"], strict=True))
            assert str(before["optimizer_state"]) == str(after["optimizer_state"])  # Adam moments and steps
            with grpc.insecure_channel(s.address) as ch:
                st = ps_pb2_grpc.AdminStub(ch).GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT).status
            assert st.restored_from_version == 12 and st.last_checkpoint_version == 12
        # the worker (same incarnation) carries on where it stopped
        train([s.address for s in restarted], steps=3)
        assert all(s.shard.version == 15 for s in restarted)
    finally:
        for s in restarted:
            s.stop(grace=0.5)


def test_admin_checkpoint_writes_now_and_needs_a_directory(tmp_path, start_cluster) -> None:
    (plain,) = start_cluster(num_shards=1, num_workers=1)
    with grpc.insecure_channel(plain.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ps_pb2_grpc.AdminStub(ch).Checkpoint(ps_pb2.CheckpointRequest(), timeout=RPC_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--checkpoint-dir" in err.value.details()

    (shard,) = start_cluster(num_shards=1, num_workers=1, checkpoint_dir=str(tmp_path))
    train([shard.address], steps=3)
    with grpc.insecure_channel(shard.address) as ch:
        reply = ps_pb2_grpc.AdminStub(ch).Checkpoint(ps_pb2.CheckpointRequest(), timeout=RPC_TIMEOUT)
    assert reply.version == 3 and reply.path.endswith("shard-0-v000000000003.pt")
    assert CheckpointStore(tmp_path, 0).latest_version() == 3


def test_checkpoint_of_another_cluster_shape_is_refused(tmp_path) -> None:
    from ps_server.core.errors import CheckpointError

    shard = start_server(ServerConfig(shard_index=0, num_shards=1, num_workers=1, port=0, checkpoint_dir=str(tmp_path)))
    try:
        train([shard.address], steps=2)
    finally:
        shard.stop(grace=0.5)
    with pytest.raises(CheckpointError, match="same --num-shards/--num-workers"):
        start_server(ServerConfig(shard_index=0, num_shards=1, num_workers=3, port=0, checkpoint_dir=str(tmp_path)))
