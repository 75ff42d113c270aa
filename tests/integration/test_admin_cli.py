"""``ps-admin`` against live shards: the status table, --json, errors, and ``top`` in an 80x24 tmux."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import uuid

import grpc
import pytest

from ps_proto.v1 import ps_pb2
from ps_server.admin_cli import ShardResult, render_top

ADMIN = [sys.executable, "-m", "ps_server.admin_cli"]


def ps_admin(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PS_")} | (env or {})
    return subprocess.run([*ADMIN, *args], capture_output=True, text=True, timeout=60, env=environ)


@pytest.fixture
def cluster(start_shards, start_trainer, wait_until):
    """Two shards and one rank training in the background (at least 3 steps done)."""
    shards = start_shards(2, num_workers=1)
    trainer = start_trainer([s.address for s in shards], pace=0.05)
    wait_until(lambda: trainer.steps >= 3 or trainer.error, 30, "3 training steps")
    assert trainer.error is None, trainer.error
    return shards


def test_status_table_over_two_shards(cluster) -> None:
    servers = ",".join(s.address for s in cluster)
    result = ps_admin("--servers", servers, "status")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("grpc-ps: 2/2 shards, mode sync, version ")
    assert "workers 1/1 live" in lines[0]
    header = lines[2].split()
    assert header == [
        "SHARD",
        "ADDRESS",
        "MODE",
        "VERSION",
        "LIVE",
        "CLOCKS",
        "GAP",
        "RECV",
        "SENT",
        "REJ",
        "INIT",
        "PLAN",
    ]
    digest = cluster[0].shard.plan.digest[:8]
    for k, s in enumerate(cluster):
        row = lines[3 + k].split()
        assert row[:3] == [f"{k}/2", s.address, "sync"]
        assert int(row[3]) >= 3 and row[4] == "1/1" and row[6] == "0"
        assert row[-2:] == ["yes", digest]
    ranks = lines[lines.index("") + 1 + lines[lines.index("") + 1 :].index("") + 1 :]
    assert ranks[0].split()[:5] == ["RANK", "STATE", "CLOCK", "PUSHES", "SEEN"]
    assert ranks[1].split()[:2] == ["0", "live"]


def test_status_json(cluster) -> None:
    result = ps_admin("--servers", ",".join(s.address for s in cluster), "status", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert [sh["status"]["shard_index"] for sh in report["shards"]] == [0, 1]
    assert all(sh["mode"] == "sync" and sh["live_workers"] == 1 and sh["clock_gap"] == 0 for sh in report["shards"])
    assert all(int(sh["status"]["version"]) >= 3 for sh in report["shards"])


def test_unreachable_shard_is_one_line_and_exit_1(cluster) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    result = ps_admin("--servers", f"{cluster[0].address},{dead}", "--timeout", "3", "status")
    assert result.returncode == 1
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"ps-admin: {dead}: UNAVAILABLE: ")
    assert "1/2 shards" in result.stdout and "down" in result.stdout


def test_admin_token(start_shards) -> None:
    (s,) = start_shards(1, admin_token="admin-secret")
    refused = ps_admin("--servers", s.address, "status")
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == [
        f"ps-admin: {s.address}: UNAUTHENTICATED: /ps.v1.Admin/GetStatus needs 'authorization: Bearer <token>' "
        "with the admin token (PS_ADMIN_TOKEN). (pass --admin-token or set PS_ADMIN_TOKEN)"
    ]
    assert ps_admin("--servers", s.address, "--admin-token", "admin-secret", "status").returncode == 0
    assert ps_admin("--servers", s.address, "status", env={"PS_ADMIN_TOKEN": "admin-secret"}).returncode == 0
    top = ps_admin("--servers", s.address, "--admin-token", "wrong", "top", "--iterations", "5")
    assert top.returncode == 1 and "UNAUTHENTICATED" in top.stderr


def test_top_in_an_80x24_tmux(cluster, tool, wait_until) -> None:
    tmux = tool("tmux")
    socket_name, session = f"ps-ops-{uuid.uuid4().hex[:8]}", f"ps-admin-top-{uuid.uuid4().hex[:8]}"
    base = [tmux, "-L", socket_name, "-f", "/dev/null"]

    def tm(*args: str) -> str:
        return subprocess.run([*base, *args], capture_output=True, text=True, timeout=10, check=True).stdout

    command = shlex.join(
        [*ADMIN, "--servers", ",".join(s.address for s in cluster), "top", "--iterations", "2", "--interval", "0.5"]
    )
    try:
        tm("new-session", "-d", "-s", session, "-x", "80", "-y", "24")
        tm("set-option", "-t", session, "status", "off")
        assert tm("display", "-p", "-t", session, "#{pane_width}x#{pane_height}").strip() == "80x24"
        tm("send-keys", "-t", session, f"{command}; echo __exit=$?", "Enter")

        def finished() -> str | None:
            text = tm("capture-pane", "-p", "-J", "-t", session)
            return text if re.search(r"__exit=\d+", text) else None

        screen = wait_until(finished, 30, "ps-admin top to finish in tmux")
    finally:
        subprocess.run([*base, "kill-session", "-t", session], capture_output=True, timeout=10)
    assert "__exit=0" in screen, screen
    lines = screen.splitlines()
    assert all(len(line) <= 80 for line in lines), screen
    assert len(lines) <= 24
    text = "\n".join(lines)
    for needle in ("ps-admin top", "grpc-ps: 2/2 shards, mode sync", "SHARD", "VERSION", "0/2", "1/2", "RANK", "live"):
        assert needle in text, f"{needle!r} missing from:\n{screen}"


def test_top_frame_fits_any_cluster_in_80x24() -> None:
    workers = [
        ps_pb2.WorkerStatus(
            rank=r,
            incarnation=1_795_000_000_000_000 + r,
            clock=10_000 + r % 3,
            state=ps_pb2.WORKER_STATE_LIVE,
            pushes=10_000,
        )
        for r in range(64)
    ]
    results = [
        ShardResult(
            k,
            f"ps-{k}.ps.training.svc.cluster.local:50051",
            ps_pb2.ShardStatus(
                shard_index=k,
                num_shards=8,
                config=ps_pb2.ClusterConfig(mode=ps_pb2.MODE_SYNC, num_workers=64),
                initialized=True,
                version=10_000,
                plan_digest="ab" * 32,
                workers=workers,
                received_bytes=123 * 2**40,
                sent_bytes=456 * 2**30,
                rejected_requests=12345,
            ),
        )
        for k in range(7)
    ]
    results.append(ShardResult(7, "ps-7:50051", code=grpc.StatusCode.UNAVAILABLE, details="connection refused " * 10))
    lines = render_top(results, 80, 24, 2.0, time.time())
    assert len(lines) <= 23 and all(len(line) <= 80 for line in lines)
    assert lines[-1].startswith("... ") and "more lines" in lines[-1]
    assert any(line.startswith("! ps-7:50051: UNAVAILABLE") for line in lines)
