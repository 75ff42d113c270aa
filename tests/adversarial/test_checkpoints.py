"""Checkpoints under hostile load and unlucky disks: acknowledged checkpoints are never lost to a race,
and a failed write is counted, named and never silent."""

from __future__ import annotations

import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ps_admin.client import ShardResult
from ps_admin.view import render_status
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_server.checkpoint.files import CheckpointStore
from ps_server.metrics import CHECKPOINT_FAILURE_REASONS
from ps_worker import DistributedOptimizer, PSClient
from tests.unit.test_checkpoint import fill_disk

RPC_TIMEOUT = 30.0
"""Seconds an Admin call may take here: checkpoint writes queue behind each other on a loaded disk."""


def test_acknowledged_checkpoints_survive_parallel_admin_checkpoints(
    tmp_path: Path, start_cluster, start_trainer, wait_until
) -> None:
    """Item 6. A shard checkpointing every version while it trains gets 160 Admin/Checkpoint calls from
    8 threads. Every acknowledged (version, path) stays on disk until --checkpoint-keep newer ones
    exist; the newest version on disk and GetStatus' last_checkpoint_version never go backwards."""
    keep, calls = 3, 160
    (shard,) = start_cluster(1, num_workers=1, checkpoint_dir=str(tmp_path), checkpoint_every=1, checkpoint_keep=keep)
    trainer = start_trainer([shard.address], pace=0.005)
    wait_until(lambda: shard.shard.version >= 5, 60, "training to reach version 5")
    store = CheckpointStore(tmp_path, 0, keep=keep)  # the test's own view of the directory

    acked: list[tuple[int, str]] = []
    problems: list[str] = []
    done = threading.Event()

    def checkpoint(stub: ps_pb2_grpc.AdminStub) -> None:
        reply = stub.Checkpoint(ps_pb2.CheckpointRequest(), timeout=RPC_TIMEOUT)
        acked.append((reply.version, reply.path))

    def watch(stub: ps_pb2_grpc.AdminStub) -> None:
        """Until the calls end (bounded by the pool): list the directory and read the status."""
        newest_on_disk, last_status = -1, -1
        while not done.is_set():
            known = list(acked)  # acknowledged before this listing began
            # which are gone, looked up before the listing: a checkpoint pruned after it is then not
            # blamed on a listing that predates its newer ones (newer ones only go when keep newer exist)
            gone = [version for version, path in known if not Path(path).exists()]
            on_disk = [c.version for c in store.checkpoints()]
            if on_disk and on_disk[-1] < newest_on_disk:
                problems.append(f"newest checkpoint on disk went back from {newest_on_disk} to {on_disk[-1]}")
            newest_on_disk = max(newest_on_disk, on_disk[-1] if on_disk else -1)
            for version in gone:
                if sum(v > version for v in on_disk) < keep:
                    problems.append(f"acknowledged checkpoint {version} deleted; on disk: {on_disk}")
            status = stub.GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT).status
            if status.HasField("last_checkpoint_version"):
                if status.last_checkpoint_version < last_status:
                    problems.append(
                        f"last_checkpoint_version went back from {last_status} to {status.last_checkpoint_version}"
                    )
                last_status = max(last_status, status.last_checkpoint_version)

    with grpc.insecure_channel(shard.address) as channel:
        stub = ps_pb2_grpc.AdminStub(channel)
        watcher = threading.Thread(target=watch, args=(stub,), daemon=True)
        watcher.start()
        started = time.monotonic()
        try:
            with ThreadPoolExecutor(max_workers=8) as pool:
                for f in [pool.submit(checkpoint, stub) for _ in range(calls)]:
                    f.result(timeout=max(1.0, 600 - (time.monotonic() - started)))
        finally:
            done.set()
            watcher.join(RPC_TIMEOUT * 2)
    trainer.stop()
    assert not watcher.is_alive()
    assert len(acked) == calls
    wait_until(
        lambda: shard.shard.status().last_checkpoint_version == shard.shard.version, 60, "the last snapshot's write"
    )
    on_disk = [c.version for c in store.checkpoints()]
    assert on_disk[-1] == shard.shard.version and len(on_disk) == keep
    for version, path in acked:
        assert Path(path).name == store.path_for(version).name
        if not Path(path).exists() and sum(v > version for v in on_disk) < keep:
            problems.append(f"acknowledged checkpoint {version} deleted; on disk at the end: {on_disk}")
    distinct = list(dict.fromkeys(problems))
    assert not distinct, f"{len(distinct)} distinct problems, first: {distinct[:5]}"


def train_steps(address: str, steps: int) -> None:
    """Rank 0 of one initializes the shard and trains ``steps`` steps (every RPC bounded)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    with PSClient([address], rank=0, num_workers=1, timeout=RPC_TIMEOUT, retry_deadline=10) as client:
        client.init(model, {"name": "sgd", "lr": 0.1}, init_timeout=RPC_TIMEOUT)
        opt = DistributedOptimizer(model, client)
        for _ in range(steps):
            opt.zero_grad()
            model(torch.ones(3, 4)).pow(2).mean().backward()
            opt.step()


def replace_with_file(directory: Path) -> None:
    """The operator's mistake: the checkpoint directory is removed and a file takes its name."""
    shutil.rmtree(directory)
    directory.write_text("not a directory\n")


def failure_samples(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        s.labels["reason"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "ps_checkpoint_failures_total"
    }


def test_failed_checkpoint_writes_are_counted_named_and_shown(
    tmp_path: Path, start_cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 11. A checkpoint directory replaced by a file, then a full disk: Admin/Checkpoint fails
    with INTERNAL naming the cause ("No space left on device", not torch's "unexpected pos"),
    GetStatus counts the failures and shows the newest error (so does ``ps-admin status``),
    ps_checkpoint_failures_total{reason} counts them by reason; a later successful write clears the
    error, the count stays."""
    directory = tmp_path / "ckpt"
    (shard,) = start_cluster(1, num_workers=1, checkpoint_dir=str(directory))
    train_steps(shard.address, 2)
    assert failure_samples(shard.metrics_url) == dict.fromkeys(CHECKPOINT_FAILURE_REASONS, 0.0)
    with grpc.insecure_channel(shard.address) as channel:
        admin = ps_pb2_grpc.AdminStub(channel)

        def checkpoint_fails() -> str:
            with pytest.raises(grpc.RpcError) as err:
                admin.Checkpoint(ps_pb2.CheckpointRequest(), timeout=RPC_TIMEOUT)
            assert err.value.code() == grpc.StatusCode.INTERNAL
            return err.value.details()

        def status() -> ps_pb2.ShardStatus:
            return admin.GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT).status

        assert status().checkpoint_failures == 0 and status().last_checkpoint_error == ""
        replace_with_file(directory)
        details = checkpoint_fails()
        assert f"Cannot create checkpoint directory {directory}: File exists" in details, details
        st = status()
        assert st.checkpoint_failures == 1 and st.last_checkpoint_error == details

        directory.unlink()
        fill_disk(monkeypatch, "dev_full")
        details = checkpoint_fails()
        assert "No space left on device; free some space or pass another --checkpoint-dir" in details, details
        assert "unexpected pos" not in details
        st = status()
        assert st.checkpoint_failures == 2 and st.last_checkpoint_error == details
        shown = render_status([ShardResult(0, shard.address, st)])
        assert f"! shard 0: 2 checkpoint write(s) failed, the newest: {details}" in shown, shown
        assert not [p.name for p in directory.iterdir()], "a failed write left a file behind"
        found = failure_samples(shard.metrics_url)
        assert found == {**dict.fromkeys(CHECKPOINT_FAILURE_REASONS, 0.0), "not_a_directory": 1.0, "no_space": 1.0}

        monkeypatch.undo()
        reply = admin.Checkpoint(ps_pb2.CheckpointRequest(), timeout=RPC_TIMEOUT)
        assert reply.version == 2 and Path(reply.path).exists()
        st = status()
        assert st.checkpoint_failures == 2 and st.last_checkpoint_error == "" and st.last_checkpoint_version == 2
        assert not [line for line in render_status([ShardResult(0, shard.address, st)]) if "checkpoint" in line]


def test_sigterm_exits_nonzero_when_the_final_checkpoint_fails(tmp_path: Path) -> None:
    """Item 11. A real ps-server whose checkpoint directory was replaced by a file gets SIGTERM: its
    final checkpoint fails, so it exits 1 and says why, instead of exiting 0 as if it were saved."""
    directory = tmp_path / "ckpt"
    argv = [sys.executable, "-m", "ps_server.cli", "--shard-index", "0", "--num-shards", "1", "--num-workers", "1"]
    argv += ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--checkpoint-dir", str(directory)]
    stderr_path = tmp_path / "shard.log"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        lines: queue.Queue[str] = queue.Queue()
        assert proc.stdout is not None
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
        deadline = time.monotonic() + 120
        address = ""
        while not address:
            remaining = deadline - time.monotonic()
            assert remaining > 0 and proc.poll() is None, f"ps-server did not start: {stderr_path.read_text()}"
            try:
                line = lines.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if "listening on" in line:
                address = line.rsplit(" ", 1)[1].strip()
        train_steps(address, 3)
        replace_with_file(directory)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    log = stderr_path.read_text()
    assert rc == 1, log
    assert "ps-server: final checkpoint of shard 0 at version 3 failed (none was written): " in log, log
    assert f"Cannot create checkpoint directory {directory}: File exists; make it a directory writable" in log, log
