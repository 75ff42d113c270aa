"""Checkpoints wired into shards: periodic at the same versions on every sync shard, on stop, on
demand (Admin/Checkpoint); a restarted shard resumes exactly and says so."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_server.checkpoint.files import CheckpointStore
from ps_server.config import ServerConfig
from ps_server.membership.ranks import WorkerState
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


def test_sync_shards_checkpoint_the_same_versions_and_resume_exactly(tmp_path, start_cluster) -> None:
    shards = start_cluster(2, num_workers=1, checkpoint_dir=str(tmp_path), checkpoint_every=5, checkpoint_keep=2)
    try:
        train([s.address for s in shards], steps=12)
        states = [s.shard.export_state() for s in shards]
    finally:
        for s in shards:
            s.stop(grace=0.5)  # writes a final checkpoint at version 12
    versions = [[c.version for c in CheckpointStore(tmp_path, k).checkpoints()] for k in range(2)]
    assert versions == [[10, 12], [10, 12]]  # every 5 versions, the same on both shards; keep 2

    restarted = [start_cluster.restart(s) for s in shards]
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


def test_a_checkpoint_restores_onto_another_worker_count_but_not_another_shard_count(tmp_path, start_cluster) -> None:
    from ps_common.errors import CheckpointError

    (shard,) = start_cluster(1, num_workers=1, checkpoint_dir=str(tmp_path))
    try:
        train([shard.address], steps=2)
    finally:
        shard.stop(grace=0.5)
    (again,) = start_cluster(1, num_workers=3, checkpoint_dir=str(tmp_path))  # --num-workers changed: a resize
    st = again.shard.status()
    assert st.num_workers == 3 and [w.state for w in st.workers] == [WorkerState.PENDING] * 3
    assert st.version == 2 and "restored onto --num-workers 3" in st.membership.reason
    again.stop(grace=0.5)
    config = ServerConfig(shard_index=0, num_shards=2, num_workers=3, port=0, checkpoint_dir=str(tmp_path))
    with pytest.raises(CheckpointError, match="same --num-shards") as refused:
        start_cluster.start(config)
    assert f"`ps-admin reshard --from {tmp_path} --to 2`" in str(refused.value)  # the way out, for this directory


@pytest.mark.parametrize("final", [False, True], ids=["crash", "stop"])
def test_push_lost_in_a_restart_is_pushed_again(tmp_path, start_cluster, final) -> None:
    """Rank 0's push is acknowledged into an open round, then the shard dies before the round
    closes (``crash``: no final checkpoint; ``stop``: a graceful stop, whose final checkpoint of the
    same version leaves the held push out, its remembered answer too) and restarts from the previous
    round's checkpoint: rank 0's pull is refused with PUSH_LOST, it pushes again (taken, not
    answered as a duplicate), and the round completes for both ranks."""
    (shard,) = start_cluster(1, num_workers=2, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    models = [torch.nn.Linear(3, 1, bias=False) for _ in range(2)]
    for m in models:
        torch.nn.init.ones_(m.weight)
    clients = [PSClient([shard.address], rank=r, num_workers=2, incarnation=1, timeout=RPC_TIMEOUT) for r in range(2)]
    try:
        for c, m in zip(clients, models, strict=True):
            c.init(m, {"name": "sgd", "lr": 0.5})  # rank 0 writes; rank 1 finds the shard initialized
        grads = {"weight": torch.ones(1, 3)}
        for c in clients:
            c.push(grads)
        for c, m in zip(clients, models, strict=True):
            assert c.pull({"weight": m.weight.data}) == 1  # round 0 applied and checkpointed at version 1
        clients[0].push(grads)  # round 1: acknowledged, held, not applied
        if not final:
            shard.checkpointer.close(final=False)  # a crash: no final checkpoint
            shard.checkpointer = None
        shard.stop(grace=0)
        restarted = start_cluster.restart(shard, same_port=True)
        assert restarted.shard.restored_from_version == 1 and restarted.shard.status().round_ranks == ()
        result: list[int] = []
        puller = threading.Thread(target=lambda: result.append(clients[0].pull({"weight": models[0].weight.data})))
        puller.start()
        clients[1].push(grads)
        assert clients[1].pull({"weight": models[1].weight.data}) == 2
        puller.join(timeout=RPC_TIMEOUT * 2)
        assert result == [2]
        assert clients[0].recoveries["PUSH_LOST"] == 1
        assert torch.equal(models[0].weight, models[1].weight)
        assert torch.allclose(models[0].weight, torch.full((1, 3), 1.0 - 0.5 - 0.5))
    finally:
        for c in clients:
            c.close()
