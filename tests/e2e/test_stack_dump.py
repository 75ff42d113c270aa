"""``kill -USR1`` on a running ``ps-server`` writes every thread's stack to its stderr (its log) and
the shard goes on serving: how an operator sees what a stuck shard or worker waits on."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.processes import wait_for, wait_for_listening

SERVER = Path(sys.executable).with_name("ps-server")


@pytest.mark.timeout(120)
def test_sigusr1_dumps_every_thread_and_the_shard_keeps_serving(tmp_path) -> None:
    log = tmp_path / "shard.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [str(SERVER), "--num-shards", "1", "--shard-index", "0", "--num-workers", "1"]
            + ["--port", "0", "--metrics-port", "-1"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        address = wait_for_listening(proc)
        proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: "Thread 0x" in log.read_text(), 30, "a stack dump in the shard's stderr")
        dump = log.read_text()
        assert dump.count("Thread 0x") >= 2  # all threads: the main one and gRPC's/the shard's
        assert "ps_server" in dump  # Python frames of the shard itself
        assert proc.poll() is None, "SIGUSR1 stopped the shard"
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.terminate()
        proc.wait(30)
