"""A model wrapped in DistributedDataParallel as well as pushed through grpc-ps gets one WARNING at
``PSClient.init`` (issue 44): the process group is for metrics and barriers, gradients go through the shards."""

from __future__ import annotations

import logging
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ps_worker import PSClient, env
from tests.conftest import RPC_TIMEOUT, small_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_ddp_wrapped_model_is_warned_about_once(start_cluster, caplog) -> None:
    env._ddp_warned.clear()  # noqa: SLF001 - once per process: this test starts from none
    cluster = start_cluster(num_shards=1, num_workers=1, mode="sync")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        wrapped = DistributedDataParallel(small_model())
        caplog.set_level(logging.WARNING, logger="ps_worker.env")
        with PSClient(cluster.addresses, rank=0, num_workers=1, timeout=RPC_TIMEOUT) as c:
            c.init(wrapped, {"name": "sgd", "lr": 0.1})
            params = {k: p.data for k, p in wrapped.named_parameters()}
            wrapped(torch.randn(4, 8)).sum().backward()
            c.push_pull({k: p.grad for k, p in wrapped.named_parameters()}, params)  # it still trains
        with PSClient(cluster.addresses, rank=0, num_workers=1, timeout=RPC_TIMEOUT) as again:
            again.init(wrapped, {"name": "sgd", "lr": 0.1})
    finally:
        dist.destroy_process_group()
    warned = [r for r in caplog.records if "DistributedDataParallel" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "Pass the bare model (ddp.module)" in warned[0].getMessage()
    assert cluster[0].shard.version == 1
