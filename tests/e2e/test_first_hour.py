"""A user's first hour: every mistake answered at once and by name, every summary true.

Real shards over real gRPC on 127.0.0.1:0; the CLI as a user runs it (subprocess), with bounded waits.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch

from ps_server.config import ServerConfig
from ps_server.server import start_server
from ps_worker import PSClient
from ps_worker.errors import RoundTimeoutError, ShardError, ShardUnreachableError
from tests.conftest import small_model


def dead_address() -> str:
    """``127.0.0.1:PORT`` where nothing listens (a port bound, read and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def shards():
    started = []

    def start(n: int = 1, num_workers: int = 1, **config):
        for k in range(n):
            started.append(
                start_server(ServerConfig(shard_index=k, num_shards=n, num_workers=num_workers, port=0, **config))
            )
        return started[-n:]

    yield start
    for s in started:
        s.stop(grace=0.5)


# ---------------------------------------------------------------------- unreachable shards
def test_unreachable_shard_is_named_within_seconds(shards) -> None:
    """One shard of two not started: the client names that address within --retry-deadline, not the
    60 s --timeout."""
    (good,) = shards(2, 1)[:1]
    dead = dead_address()
    client = PSClient([f"127.0.0.1:{good.port}", dead], rank=0, num_workers=1, timeout=60.0, retry_deadline=3.0)
    start = time.monotonic()
    try:
        with pytest.raises(ShardUnreachableError) as err:
            client.init(small_model(), {"name": "sgd", "lr": 0.1})
    finally:
        client.close()
    assert time.monotonic() - start < 10
    assert err.value.address == dead
    assert dead in str(err.value) and "is the shard running? check --servers" in str(err.value)
    assert isinstance(err.value, ShardError)  # and a grpc.RpcError: .code() still works
    assert err.value.code().name in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


@pytest.mark.parametrize("which", ["nothing listening", "one shard of two"])
def test_ps_worker_names_the_unreachable_address(shards, which) -> None:
    dead = dead_address()
    servers = dead if which == "nothing listening" else f"127.0.0.1:{shards(2, 1)[0].port},{dead}"
    argv = [sys.executable, "-m", "ps_worker.workloads.cli", "--servers", servers, "--rank", "0", "--num-workers", "1"]
    argv += ["--retry-deadline", "3", "--metrics-port", "-1", "digits"]
    start = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert out.returncode == 1, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ps-worker rank 0: Shard " + dead), out.stderr[-2000:]
    assert "is the shard running? check --servers" in last
    assert "Traceback" not in out.stderr
    # before: Join waited the whole --timeout (60 s) whatever --retry-deadline said
    assert took < 50, f"took {took:.0f} s"


def test_with_default_flags_the_address_is_named_within_seconds(shards) -> None:
    """Default --retry-deadline (120 s): the worker keeps trying (a shard may still be starting), but
    within a few seconds of its first attempt a warning names the unreachable address, with the hint."""
    import signal
    import threading

    dead = dead_address()
    servers = f"127.0.0.1:{shards(2, 1)[0].port},{dead}"
    argv = [sys.executable, "-m", "ps_worker.workloads.cli", "--servers", servers, "--rank", "0", "--num-workers", "1"]
    proc = subprocess.Popen([*argv, "digits"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: [seen.append((time.monotonic(), line)) for line in proc.stderr])
    reader.start()
    try:
        stop = time.monotonic() + 120
        while time.monotonic() < stop and not any(dead in line for _, line in seen):
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        reader.join(timeout=10)
    connecting = next(t for t, line in seen if "metrics on" in line)  # printed just before the first Join
    warned, line = next((t, line) for t, line in seen if dead in line)
    assert "is the shard running? check --servers" in line and "--retry-deadline" in line
    assert warned - connecting < 10, f"named after {warned - connecting:.1f} s"
    assert proc.returncode == 143


# ---------------------------------------------------------------------- round timeout names ranks
def test_round_timeout_names_the_missing_rank(shards) -> None:
    """A sync round waiting for an absent rank 1: the Python API raises RoundTimeoutError with
    .ranks == [1] and the shard's own words, not a raw _InactiveRpcError."""
    (shard,) = shards(1, 2)
    model = small_model()
    client = PSClient([f"127.0.0.1:{shard.port}"], rank=0, num_workers=2, timeout=8.0, retry_deadline=1.0)
    try:
        client.init(model, {"name": "sgd", "lr": 0.1})
        params = {k: p.data for k, p in model.named_parameters()}
        grads = {k: torch.ones_like(p) for k, p in model.named_parameters()}
        with pytest.raises(RoundTimeoutError) as err:
            client.push_pull(grads, params)
    finally:
        client.close()
    assert err.value.ranks == [1]
    assert err.value.code().name == "DEADLINE_EXCEEDED"
    assert "round waits for ranks [1]" in str(err.value) and "check those workers" in str(err.value)
    assert err.value.address == f"127.0.0.1:{shard.port}"


# ---------------------------------------------------------------------- ps-worker by hand
def _status(address: str):
    import grpc

    from ps_proto.v1 import ps_pb2, ps_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        return ps_pb2_grpc.AdminStub(ch).GetStatus(ps_pb2.GetStatusRequest(), timeout=5).status


def _wait_for(predicate, timeout: float, what: str):
    stop = time.monotonic() + timeout
    while time.monotonic() < stop:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.mark.parametrize(("signame", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_ps_worker_stops_cleanly_on_a_signal(shards, signame, code) -> None:
    """Interrupted mid-run (its sync round waits for rank 1): it leaves the shards, says so in one
    line and exits 128 + signal, no traceback. Item 5: its /metrics took a free port, announced."""
    import signal

    from ps_proto.v1 import ps_pb2

    (shard,) = shards(1, 2)
    address = f"127.0.0.1:{shard.port}"
    argv = [sys.executable, "-m", "ps_worker.workloads.cli", "--servers", address, "--rank", "0", "--num-workers", "2"]
    proc = subprocess.Popen(
        [*argv, "--steps", "50", "digits"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for(
            lambda: any(w.rank == 0 and w.state == ps_pb2.WORKER_STATE_LIVE for w in _status(address).workers),
            120,
            "rank 0 to join",
        )
        proc.send_signal(getattr(signal, signame))
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err
    assert f"ps-worker rank 0: {signame} at step 0; leaving the shards" in err
    assert [w.state for w in _status(address).workers if w.rank == 0] == [ps_pb2.WORKER_STATE_LEFT]
    url = [line for line in err.splitlines() if "metrics on http://127.0.0.1:" in line]
    assert url and not url[0].rstrip().endswith(":8000/metrics"), err[-2000:]


def test_ps_worker_prints_a_human_summary_or_json(shards) -> None:
    import json

    (shard,) = shards(1, 1)
    argv = [sys.executable, "-m", "ps_worker.workloads.cli", "--servers", f"127.0.0.1:{shard.port}", "--rank", "0"]
    argv += ["--num-workers", "1", "--steps", "20", "--metrics-port", "-1"]
    out = subprocess.run([*argv, "digits"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "ps-worker rank 0 summary"
    assert any(line.split()[:2] == ["held-out", "accuracy"] for line in lines)
    assert not any(line.lstrip().startswith("{") for line in lines)
    assert "\r" not in out.stderr  # no progress bar when stderr is not a terminal
    out = subprocess.run([*argv, "--json", "digits"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["rank"] == 0 and report["steps"] == 20 and report["workload"] == "digits"


# ---------------------------------------------------------------------- fast CLI
@pytest.mark.parametrize("command", ["ps_launch.cli", "ps_worker.workloads.cli"])
@pytest.mark.parametrize("args", [["--help"], ["--bogus"]])
def test_help_and_a_mistyped_flag_import_no_torch(command, args) -> None:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", command, *args], capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - start
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "sklearn" not in imported, sorted(m for m in imported if "torch" in m)[:5]
    assert not [m for m in imported if m.startswith("opentelemetry")]  # tracing is off: nothing of it loads
    assert took < 15, f"{took:.1f} s"
    if args == ["--help"]:
        assert out.returncode == 0 and "usage:" in out.stdout
    else:
        errors = [line for line in out.stderr.splitlines() if not line.startswith("import time:")]
        prog = "ps-launch" if command == "ps_launch.cli" else "ps-worker"
        assert out.returncode == 2
        assert errors == [f"{prog}: unrecognized arguments: --bogus (see {prog} --help)"] or (
            command == "ps_worker.workloads.cli"
            and errors[0].startswith("ps-worker: the following arguments are required")
        ), errors


def test_config_errors_are_one_line_with_a_hint() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ps_launch.cli", "--shards", "2", "--step", "5", "--mode", "syn", "digits"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "usage:" not in out.stderr, out.stderr
    assert "ps-launch: argument --mode: invalid choice: 'syn'" in out.stderr and "ps-launch --help" in out.stderr
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ps_worker.workloads.cli",
            "--servers",
            "127.0.0.1:1",
            "--rank",
            "2",
            "--num-workers",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("ps-worker: --rank must be in 0..1, got 2")


# ---------------------------------------------------------------------- one truth in GetStatus
def test_status_reports_the_learning_rate_in_force(shards) -> None:
    import grpc

    from ps_proto.v1 import ps_pb2, ps_pb2_grpc

    (shard,) = shards(1, 1)
    address = f"127.0.0.1:{shard.port}"
    client = PSClient([address], rank=0, num_workers=1, timeout=10.0)
    try:
        client.init(small_model(), {"name": "sgd", "lr": 0.1, "momentum": 0.9})
        with grpc.insecure_channel(address) as ch:
            admin = ps_pb2_grpc.AdminStub(ch)
            admin.UpdateConfig(ps_pb2.UpdateConfigRequest(learning_rate=0.05, at_version=0), timeout=10)  # now
            reply = admin.UpdateConfig(ps_pb2.UpdateConfigRequest(learning_rate=0.07), timeout=10)
            assert reply.at_version == 1  # rank 0 is live: shard 0's next round, pending until then
    finally:
        client.close()
    status = _status(address)
    assert status.config.learning_rate == pytest.approx(0.05)
    assert status.optimizer.kwargs["lr"] == pytest.approx(0.05)  # was still 0.1
    assert status.optimizer.kwargs["momentum"] == pytest.approx(0.9)


# ---------------------------------------------------------------------- smaller things
def test_ps_launch_removes_its_temporary_directory(tmp_path) -> None:
    import os

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    argv = [sys.executable, "-m", "ps_launch.cli", "--shards", "1", "--workers", "1", "--steps", "5"]
    out = subprocess.run([*argv, "--no-metrics", "--no-progress", "digits"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "removed at the end" in out.stderr
    assert not list(tmp_path.glob("ps-launch-*")), "ps-launch left its temporary directory behind"
    kept = tmp_path / "kept"
    out = subprocess.run(
        [*argv, "--log-dir", str(kept), "--no-metrics", "--no-progress", "digits"], capture_output=True, text=True
    )
    assert out.returncode == 0 and (kept / "worker-0.log").exists() and (kept / "checkpoints").is_dir()


def test_ps_admin_checkpoint_prints_an_absolute_path(tmp_path) -> None:
    """A shard started with a relative --checkpoint-dir; ps-admin runs elsewhere."""
    import re

    shard_dir = tmp_path / "shard"
    shard_dir.mkdir()
    argv = [sys.executable, "-m", "ps_server.cli", "--shard-index", "0", "--num-shards", "1", "--num-workers", "1"]
    argv += ["--port", "0", "--metrics-port", "-1", "--checkpoint-dir", "ckpt"]
    proc = subprocess.Popen(argv, cwd=shard_dir, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        stop = time.monotonic() + 120
        while "listening on" not in line and time.monotonic() < stop:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "ps-server exited"
        address = re.search(r"listening on (\S+)", line).group(1)
        client = PSClient([address], rank=0, num_workers=1, timeout=10.0)
        try:
            client.init(small_model(), {"name": "sgd", "lr": 0.1})
        finally:
            client.close()
        out = subprocess.run(
            [sys.executable, "-m", "ps_admin.cli", "--servers", address, "checkpoint"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=60,
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert out.returncode == 0, out.stderr
    path = out.stdout.split(": ", 1)[1].strip()
    assert path.startswith(str(shard_dir / "ckpt") + "/") and path.endswith(".pt"), out.stdout
