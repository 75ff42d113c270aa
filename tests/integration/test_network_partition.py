"""A network partition made with namespaces: the lease lapses, training goes on, the worker rejoins.

Two namespaces joined by a veth pair: the shard and worker 0 in one, worker 1 in the other. All
traffic stays inside the namespaces this test creates; every process runs in one of them
(``ip netns exec``), status is read from inside too. Needs root and iproute2.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest

from tests.helpers.namespaces import in_ns, sh
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="network namespaces need root and iproute2 (ip netns)",
)

TOKEN, ADMIN = "partition-worker-token", "partition-admin-token"
STATUS = """
import json, sys, grpc
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
with grpc.insecure_channel(sys.argv[1]) as ch:
    st = ps_pb2_grpc.AdminStub(ch).GetStatus(ps_pb2.GetStatusRequest(), timeout=5,
        metadata=(("authorization", "Bearer " + sys.argv[2]),)).status
print(json.dumps({"version": st.version, "states": [ps_pb2.WorkerState.Name(w.state) for w in st.workers],
                  "clocks": [w.clock for w in st.workers], "incarnations": [w.incarnation for w in st.workers]}))
"""


def test_partitioned_worker_is_evicted_and_rejoins(namespaces, tmp_path) -> None:
    ns_a, ns_b, shard_ip = namespaces
    address = f"{shard_ip}:50051"
    procs: list[subprocess.Popen] = []
    py = sys.executable

    def status() -> dict:
        out = subprocess.run(
            ["ip", "netns", "exec", ns_a, py, "-c", STATUS, address, ADMIN], capture_output=True, text=True, timeout=30
        )
        return json.loads(out.stdout) if out.returncode == 0 else {}

    try:
        shard = in_ns(
            ns_a,
            py,
            "-m",
            "ps_server.cli",
            "--shard-index",
            "0",
            "--num-shards",
            "1",
            "--num-workers",
            "2",
            "--host",
            shard_ip,
            "--port",
            "50051",
            "--lease-timeout",
            "2",
            "--token",
            TOKEN,
            "--admin-token",
            ADMIN,
            "--metrics-port",
            "-1",
            stdout=subprocess.PIPE,
            stderr=open(tmp_path / "shard.log", "w"),
        )
        procs.append(shard)
        assert shard.stdout is not None
        assert "listening on" in shard.stdout.readline()
        events: queue.Queue[tuple[int, dict]] = queue.Queue()
        steps: dict[int, int] = {0: 0, 1: 0}
        for rank, ns in ((0, ns_a), (1, ns_b)):
            w = in_ns(
                ns,
                py,
                "-m",
                "ps_worker.workloads.cli",
                "--servers",
                address,
                "--rank",
                str(rank),
                "--num-workers",
                "2",
                "--steps",
                "500",
                "--token",
                TOKEN,
                "--retry-deadline",
                "90",
                "--timeout",
                "10",
                "--metrics-port",
                "-1",
                "--events",
                "digits",
                stdout=subprocess.PIPE,
                stderr=open(tmp_path / f"worker-{rank}.log", "w"),
            )
            procs.append(w)

            def read(rank: int = rank, w: subprocess.Popen = w) -> None:
                assert w.stdout is not None
                for line in w.stdout:
                    events.put((rank, json.loads(line)))

            threading.Thread(target=read, daemon=True).start()

        def progressed(rank: int, step: int) -> Callable[[], bool]:
            def check() -> bool:
                while not events.empty():
                    r, e = events.get_nowait()
                    if e.get("event") == "step":
                        steps[r] = e["step"]
                return steps[rank] >= step

            return check

        wait_for(progressed(1, 20), 120, "worker 1 to train 20 steps")
        sh("ip", "-n", ns_b, "link", "set", f"v{ns_b[3:-1]}b", "down")  # the partition
        wait_for(lambda: status().get("states", [None, None])[1] == "WORKER_STATE_EVICTED", 30, "rank 1's eviction")
        evicted_at = steps[0]
        wait_for(progressed(0, evicted_at + 20), 60, "training to go on without rank 1")
        sh("ip", "-n", ns_b, "link", "set", f"v{ns_b[3:-1]}b", "up")
        wait_for(lambda: status().get("states", [None, None])[1] == "WORKER_STATE_LIVE", 90, "rank 1 to rejoin")
        rejoined_at = status()["clocks"][1]
        wait_for(lambda: status().get("clocks", [0, 0])[1] > rejoined_at + 5, 60, "rank 1 to be counted again")
        for w in procs[1:]:
            assert w.wait(timeout=240) == 0, (tmp_path / "worker-1.log").read_text()[-2000:]
        log = (tmp_path / "worker-1.log").read_text()
        assert "NOT_JOINED" in log, "rank 1 should have recovered from its eviction by rejoining"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
