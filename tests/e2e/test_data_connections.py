"""Data connections between real processes: ``ps-server`` offers them by default (``--data-port``
0), a worker's PushPull partitions go there (a small model's whole PushPullOnce call), and a shard
killed with SIGKILL and restarted from its checkpoint (--durable-acks) costs nothing acknowledged:
the worker's step retries on gRPC, it joins the new process (which offers a new data port) and
goes on over data connections again."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ps_worker import DistributedOptimizer, PSClient

SERVER = Path(sys.executable).with_name("ps-server")
RPC_TIMEOUT = 20.0


def start_shard(k: int, tmp_path: Path, port: int = 0) -> tuple[subprocess.Popen[str], str]:
    """Start ``ps-server`` shard ``k`` of 2 (a checkpoint every version, --durable-acks); returns it and its address."""
    argv = [str(SERVER), "--num-shards", "2", "--shard-index", str(k), "--num-workers", "1", "--port", str(port)]
    argv += [
        "--metrics-port",
        "-1",
        "--checkpoint-dir",
        str(tmp_path / f"ckpt{k}"),
        "--checkpoint-every",
        "1",
        "--durable-acks",
    ]
    with open(tmp_path / f"shard{k}.log", "a") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or ()], daemon=True).start()
    deadline = time.monotonic() + 60
    while (left := deadline - time.monotonic()) > 0:
        try:
            found = re.search(r"listening on (\S+)", lines.get(timeout=left))
        except queue.Empty:
            break
        if found:
            return proc, found.group(1)
    proc.kill()
    proc.wait(30)
    pytest.fail(f"shard {k} did not report its address within 60 s")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("partition_bytes", [2048, 4 << 20], ids=["frames", "calls"])
def test_a_killed_shard_costs_nothing_and_the_data_connections_come_back(tmp_path: Path, partition_bytes) -> None:
    """``frames``: several messages per shard, partitions as frames; ``calls``: one message per
    shard (10 KB model), each step a PushPullOnce call on the connection."""
    procs = [start_shard(k, tmp_path) for k in range(2)]
    try:
        addresses = [a for _, a in procs]
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.Tanh(), torch.nn.Linear(128, 3))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(640, 16, generator=g), torch.randint(0, 3, (640,), generator=g)
        with PSClient(
            addresses, 0, 1, incarnation=1, timeout=RPC_TIMEOUT, retry_deadline=60, partition_bytes=partition_bytes
        ) as client:
            client.init(model, {"name": "sgd", "lr": 0.05})
            opt = DistributedOptimizer(model, client)
            connected: list[list[bool]] = []
            t, deadline = 0, time.monotonic() + 90
            # 8 steps, the kill, then steps until the worker is back on both data connections (its
            # heartbeat, every lease / 3 s, brings shard 1's new data port), 4 more after that
            while t < 12 or connected[-1] != [True, True] or t < connected.index([True, True], 9) + 4:
                assert time.monotonic() < deadline, f"no data connection to the restarted shard: {connected}"
                if t == 8:  # SIGKILL shard 1 (checkpointed every version), restart it on the same port
                    old, address = procs[1]
                    os.kill(old.pid, signal.SIGKILL)
                    old.wait(30)
                    procs[1] = start_shard(1, tmp_path, port=int(address.rsplit(":", 1)[1]))
                i = (32 * t) % 640
                opt.zero_grad()
                F.cross_entropy(model(x[i : i + 32]), y[i : i + 32]).backward()
                opt.step()
                connected.append(client.transport.data_connected)
                t += 1
            assert connected[:8] == [[True, True]] * 8
            assert client.version == t  # every step applied once, on both shards (--durable-acks)
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait(30)
