"""Streamed sync rounds between hosts: the shard and worker 0 in one network namespace, worker 1 in
another, joined by a veth pair; real ``ps-server`` and worker processes. ``--stream-rounds auto``
streams these rounds (the connections do not come from loopback), bitwise the rounds of a shard
that does not stream; a worker killed mid-training ends its round's stream, every stepped
partition is put back, and the surviving worker's weights are the shard's version.

All traffic stays inside the namespaces the test creates (the ``namespaces`` fixture); every process
runs in one of them. Needs root and iproute2.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.helpers.namespaces import in_ns
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="network namespaces need root and iproute2 (ip netns)",
)

TOKEN, ADMIN = "streamed-rounds-token", "streamed-rounds-admin-token"
METRICS_PORT = 9464

WORKER = """
import json, sys, torch
import torch.nn.functional as F
from ps_worker import DistributedOptimizer, PSClient
from ps_worker.workloads.train import params_sha256
address, rank, steps, token = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64), torch.nn.Tanh(),
                        torch.nn.Linear(64, 3))
g = torch.Generator().manual_seed(rank)
with PSClient([address], rank=rank, num_workers=2, incarnation=1, timeout=20, partition_bytes=4096,
              token=token, retry_deadline=20) as c:
    c.init(m, {"name": "sgd", "lr": 0.05, "momentum": 0.9})
    opt = DistributedOptimizer(m, c)
    for t in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
        print(json.dumps({"step": t + 1}), flush=True)
    pulled = {k: torch.empty_like(p) for k, p in m.named_parameters()}
    c.pull(pulled)
    same = all(torch.equal(pulled[k], p.data) for k, p in m.named_parameters())
    print(json.dumps({"done": params_sha256(m), "same_as_shard": same, "connected": c.transport.data_connected}),
          flush=True)
"""

SCRAPE = """
import sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
for family in text_string_to_metric_families(text):
    for s in family.samples:
        if s.name == "ps_streamed_rounds_total":
            print(s.labels["outcome"], int(s.value))
"""


class Run:
    """One ``ps-server`` in namespace A and two worker processes (rank 0 in A, rank 1 in B)."""

    def __init__(self, spaces: tuple[str, str, str], tmp: Path, stream_rounds: str) -> None:
        self.ns_a, self.ns_b, ip = spaces
        self.address = f"{ip}:50051"
        self.metrics = f"http://{ip}:{METRICS_PORT}/metrics"
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.events: queue.Queue[tuple[int, dict]] = queue.Queue()
        self.steps = {0: 0, 1: 0}
        self.done: dict[int, dict] = {}
        shard = in_ns(
            self.ns_a,
            sys.executable,
            "-m",
            "ps_server.cli",
            *("--shard-index", "0", "--num-shards", "1", "--num-workers", "2", "--host", ip, "--port", "50051"),
            *("--lease-timeout", "2", "--token", TOKEN, "--admin-token", ADMIN, "--metrics-port", str(METRICS_PORT)),
            *("--stream-rounds", stream_rounds),
            stdout=subprocess.PIPE,
            stderr=open(tmp / f"shard-{stream_rounds}.log", "w"),
        )
        self.procs.append(shard)
        assert shard.stdout is not None
        lines = [shard.stdout.readline() for _ in range(2)]  # metrics on ..., then listening on ...
        if not any("listening on" in line for line in lines):
            self.stop()
            pytest.fail(f"ps-server did not start: {lines}; {(tmp / f'shard-{stream_rounds}.log').read_text()[-2000:]}")

    def worker(self, rank: int, steps: int) -> subprocess.Popen:
        w = in_ns(
            self.ns_a if rank == 0 else self.ns_b,
            sys.executable,
            "-c",
            WORKER,
            self.address,
            str(rank),
            str(steps),
            TOKEN,
            stdout=subprocess.PIPE,
            stderr=open(self.tmp / f"worker-{rank}.log", "w"),
        )
        self.procs.append(w)

        def read() -> None:
            assert w.stdout is not None
            for line in w.stdout:
                self.events.put((rank, json.loads(line)))

        threading.Thread(target=read, daemon=True).start()
        return w

    def drain(self) -> None:
        while not self.events.empty():
            rank, event = self.events.get_nowait()
            if "step" in event:
                self.steps[rank] = event["step"]
            if "done" in event:
                self.done[rank] = event

    def streamed(self) -> dict[str, int]:
        out = subprocess.run(
            ["ip", "netns", "exec", self.ns_a, sys.executable, "-c", SCRAPE, self.metrics],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return {line.split()[0]: int(line.split()[1]) for line in out.stdout.splitlines()}

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=30)


def test_rounds_between_hosts_stream_bitwise_and_a_killed_worker_puts_its_round_back(namespaces, tmp_path) -> None:
    steps = 12
    digests = {}
    for setting in ("auto", "off"):
        run = Run(namespaces, tmp_path, setting)
        try:
            workers = [run.worker(0, steps), run.worker(1, steps)]
            for rank, w in enumerate(workers):
                assert w.wait(timeout=180) == 0, (tmp_path / f"worker-{rank}.log").read_text()[-2000:]
            wait_for(lambda run=run: run.drain() or len(run.done) == 2, 30, "both workers' results")
            assert all(d["same_as_shard"] and d["connected"] == [True] for d in run.done.values()), run.done
            digests[setting] = {d["done"] for d in run.done.values()}
            counted = run.streamed()
            # auto streams rounds whose connections come from other addresses than loopback
            assert counted.get("streamed", 0) == (steps if setting == "auto" else 0), counted
            assert counted.get("put_back", 0) == 0, counted
        finally:
            run.stop()
    assert len(digests["auto"]) == 1 and digests["auto"] == digests["off"]

    run = Run(namespaces, tmp_path, "auto")
    try:
        survivor, victim = run.worker(0, 60), run.worker(1, 1000)
        wait_for(lambda: run.drain() or run.steps[1] >= 10, 120, "both workers to train 10 steps")
        victim.send_signal(signal.SIGKILL)  # mid-training: rank 0's next round streams, then loses it
        victim.wait(timeout=30)
        assert survivor.wait(timeout=180) == 0, (tmp_path / "worker-0.log").read_text()[-2000:]
        wait_for(lambda: run.drain() or 0 in run.done, 30, "rank 0's result")
        assert run.done[0]["same_as_shard"], run.done[0]  # no speculative value stayed in its weights
        counted = run.streamed()
        assert counted.get("streamed", 0) >= 9 and counted.get("put_back", 0) >= 1, counted
    finally:
        run.stop()
