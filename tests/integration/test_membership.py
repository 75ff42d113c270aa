"""Membership with real processes: a kill -9'd ps-worker is evicted (status and metrics say so)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc

from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_worker import DistributedOptimizer, PSClient
from tests.conftest import RPC_TIMEOUT
from tests.helpers.processes import wait_for


def status(address: str) -> ps_pb2.ShardStatus:
    with grpc.insecure_channel(address) as ch:
        return ps_pb2_grpc.AdminStub(ch).GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT).status


def test_kill9_worker_is_evicted_in_status_and_metrics(start_cluster) -> None:
    (shard,) = start_cluster(num_shards=1, num_workers=2, lease_timeout=1.0, metrics_port=0)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ps_worker.workloads.cli",
            "--servers",
            shard.address,
            "--rank",
            "1",
            "--num-workers",
            "2",
            "--steps",
            "100000",
            "--events",
            "--metrics-port",
            "-1",
            "digits",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        import torch

        from ps_worker.workloads.registry import get_workload

        workload = get_workload("digits")
        torch.manual_seed(0)
        model = workload.model()
        # the first round waits for rank 1's process to start (torch's import alone takes seconds on a
        # loaded machine): a deadline as long as the wait for its first step below
        with PSClient([shard.address], rank=0, num_workers=2, timeout=120) as client:
            client.init(model, {"name": "sgd", "lr": 0.1})
            opt = DistributedOptimizer(model, client)
            x = torch.zeros(4, 64)
            y = torch.zeros(4, dtype=torch.long)
            stepping = threading.Event()

            def watch() -> None:  # rank 1 is training once it reports a step
                assert worker.stdout is not None
                for line in worker.stdout:
                    if json.loads(line).get("event") == "step":
                        stepping.set()

            threading.Thread(target=watch, daemon=True).start()
            deadline = time.monotonic() + 120
            while not stepping.is_set():  # sync rounds need both ranks: rank 0 trains meanwhile
                assert time.monotonic() < deadline, "rank 1 never trained"
                opt.zero_grad()
                workload.loss(model, x, y).backward()
                opt.step()
            worker.send_signal(signal.SIGKILL)
            worker.wait(timeout=30)
            wait_for(
                lambda: status(shard.address).workers[1].state == ps_pb2.WORKER_STATE_EVICTED, 20, "rank 1's eviction"
            )
            for _ in range(3):  # the rounds go on without rank 1
                opt.zero_grad()
                workload.loss(model, x, y).backward()
                opt.step()
        text = urllib.request.urlopen(shard.metrics_url, timeout=RPC_TIMEOUT).read().decode()
        assert 'ps_workers{state="evicted"} 1.0' in text
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=30)


def test_duplicate_push_is_applied_once_over_grpc(start_cluster) -> None:
    import torch

    from tests.helpers.tensors import encode

    (shard,) = start_cluster(num_shards=1, num_workers=1)
    model = torch.nn.Linear(2, 1, bias=False)
    with (
        PSClient([shard.address], rank=0, num_workers=1, incarnation=7, timeout=RPC_TIMEOUT) as client,
        grpc.insecure_channel(shard.address) as ch,
    ):
        client.init(model, {"name": "sgd", "lr": 1.0})
        stub = ps_pb2_grpc.ParameterServiceStub(ch)
        header = ps_pb2.PushHeader(
            rank=0,
            incarnation=7,
            clock=0,
            version=0,
            plan_digest=client.plan.digest,
            session=client.session.sessions[0],
        )
        part = ps_pb2.Partition(
            key="weight", offset=0, length=2, dtype=ps_pb2.DTYPE_FLOAT32, data=encode(torch.ones(2))
        )

        def push() -> ps_pb2.PushResponse:
            reqs = [ps_pb2.PushRequest(header=header), ps_pb2.PushRequest(partition=part)]
            return stub.Push(iter(reqs), timeout=RPC_TIMEOUT)

        first, second = push(), push()
        assert not first.duplicate and second.duplicate and second.version == first.version
        before = model.weight.detach().clone()
        assert client.pull({"weight": model.weight.data}, min_version=1) == 1
        assert torch.equal(model.weight, before - 1.0)  # one step of lr 1.0, not two
        assert status(shard.address).workers[0].pushes == 1
