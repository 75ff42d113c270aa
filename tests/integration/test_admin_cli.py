"""``ps-admin`` against live shards: the status table, --json, errors, ``top`` over WatchStatus in an 80x24
tmux, ``set`` (UpdateConfig), ``checkpoint`` (Checkpoint) and ``evict`` (EvictWorker) on every shard, tokens."""

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
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import pytest
import torch

from ps_admin.client import ShardResult, Watcher, watch
from ps_admin.view import render_top
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_server.config import ServerConfig
from ps_server.server import ShardServer
from ps_worker import PSClient
from tests.conftest import RPC_TIMEOUT, small_model

ADMIN = [sys.executable, "-m", "ps_admin.cli"]


def ps_admin(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PS_")} | (env or {})
    return subprocess.run([*ADMIN, *args], capture_output=True, text=True, timeout=60, env=environ)


def servers_of(shards: Sequence[ShardServer]) -> str:
    return ",".join(s.address for s in shards)


def statuses(shards: Sequence[ShardServer], token: str = "") -> list[ps_pb2.ShardStatus]:
    """Every shard's GetStatus, asked directly (not through ps-admin)."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    out = []
    for s in shards:
        with grpc.insecure_channel(s.address) as ch:
            stub = ps_pb2_grpc.AdminStub(ch)
            out.append(stub.GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT, metadata=metadata).status)
    return out


def rpc_count(shard: ShardServer, method: str, code: str) -> float:
    """How many ``method`` calls ``shard`` finished with ``code`` (its ps_rpc_duration_seconds)."""
    assert shard.metrics is not None
    labels = {"method": f"ps.v1.Admin/{method}", "code": code}
    return shard.metrics.registry.get_sample_value("ps_rpc_duration_seconds_count", labels) or 0.0


@pytest.fixture
def training(start_cluster, start_trainer, wait_until):
    """Two shards and one rank training in the background (at least 3 steps done): (shards, trainer)."""
    shards = start_cluster(2, num_workers=1)
    trainer = start_trainer([s.address for s in shards], pace=0.05)
    wait_until(lambda: trainer.steps >= 3 or trainer.error, 30, "3 training steps")
    assert trainer.error is None, trainer.error
    return shards, trainer


@pytest.fixture
def cluster(training):
    """The shards of :func:`training`."""
    return training[0]


@pytest.fixture
def waiting_round(start_cluster, wait_until) -> Iterator[tuple[list[ShardServer], Future[int]]]:
    """Two shards of a 2-rank sync cluster where rank 0 pushed round 0 and waits in a pull; rank 1
    never comes. Yields (shards, the pull's future)."""
    shards = start_cluster(2, num_workers=2)
    client = PSClient([s.address for s in shards], rank=0, num_workers=2, timeout=30, retry_deadline=5)
    pool = ThreadPoolExecutor(1)
    try:
        model = small_model()
        client.init(model, {"name": "sgd", "lr": 0.1}, init_timeout=RPC_TIMEOUT)
        client.push({k: torch.ones_like(p) for k, p in model.named_parameters()})
        pulled = pool.submit(client.pull, dict(model.named_parameters()))
        wait_until(
            lambda: all(list(st.round_waiting_for) == [1] for st in statuses(shards)), 30, "round 0 to wait for rank 1"
        )
        assert not pulled.done()
        yield shards, pulled
    finally:
        for s in shards:  # wakes a pull still waiting, so teardown never hangs
            s.stop(grace=0.5)
        pool.shutdown(wait=True, cancel_futures=True)
        client.close()


def test_status_table_over_two_shards(cluster) -> None:
    servers = ",".join(s.address for s in cluster)
    result = ps_admin("--servers", servers, "status")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("grpc-ps: 2/2 shards, mode sync, version ")
    assert "workers 1/1 live" in lines[0]
    assert lines[1] == "settings: lr 0.01, sync quorum all, round timeout off"
    assert lines[2].startswith("membership: epoch ") and "(cluster " in lines[2]  # formed at the first Join
    top = lines.index("") + 1
    header = lines[top].split()
    assert header == [
        "SHARD",
        "ADDRESS",
        "MODE",
        "VERSION",
        "LIVE",
        "CLOCKS",
        "GAP",
        "STALENESS",
        "REFUSED",
        "RECV",
        "SENT",
        "REJ",
        "INIT",
        "PLAN",
    ]
    digest = cluster[0].shard.plan.digest[:8]
    for k, s in enumerate(cluster):
        row = lines[top + 1 + k].split()
        assert row[:3] == [f"{k}/2", s.address, "sync"]
        assert int(row[3]) >= 3 and row[4] == "1/1" and row[6] == "0" and row[7:9] == ["0", "0"]
        assert row[-2:] == ["yes", digest]
    ranks = lines[lines.index("") + 1 + lines[lines.index("") + 1 :].index("") + 1 :]
    assert ranks[0].split()[:6] == ["RANK", "STATE", "CLOCK", "PUSHES", "SEEN", "ROUND"]
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


def test_admin_token(start_cluster) -> None:
    (s,) = start_cluster(1, num_workers=1, admin_token="admin-secret")
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
    for s in cluster:  # top followed one WatchStatus stream per shard, cancelled on exit, and never polled
        wait_until(lambda s=s: rpc_count(s, "WatchStatus", "CANCELLED") >= 1, 10, "the stream to end as CANCELLED")
        assert rpc_count(s, "GetStatus", "OK") == 0
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


# ---------------------------------------------------------------------------------------- WatchStatus
def test_watch_cancels_its_stream_when_closed_or_stopped(start_cluster, wait_until) -> None:
    (s,) = start_cluster(1, num_workers=1)
    with grpc.insecure_channel(s.address) as ch:
        stream = watch(ps_pb2_grpc.AdminStub(ch), 0.2, timeout=RPC_TIMEOUT)
        first, second = next(stream), next(stream)
        assert first.shard_index == second.shard_index == 0
        stream.close()
        wait_until(lambda: rpc_count(s, "WatchStatus", "CANCELLED") == 1, 10, "the closed stream to be cancelled")
        watcher = Watcher([s.address], "", 0.2, RPC_TIMEOUT)
        watcher.wait_all(time.monotonic() + RPC_TIMEOUT)
        assert watcher.snapshot()[0].ok
        watcher.close()
        wait_until(lambda: rpc_count(s, "WatchStatus", "CANCELLED") == 2, 10, "the watcher's stream to be cancelled")
    assert rpc_count(s, "GetStatus", "OK") == 0


def test_watcher_reconnects_when_a_shard_restarts(start_cluster, wait_until) -> None:
    (s,) = start_cluster(1, num_workers=1)
    watcher = Watcher([s.address], "", 0.2, 2.0)
    try:
        wait_until(lambda: watcher.snapshot()[0].ok, 10, "the first status")
        assert watcher.snapshot()[0].status.config.mode == ps_pb2.MODE_SYNC
        s.stop(grace=0.5)
        wait_until(lambda: watcher.snapshot()[0].code == grpc.StatusCode.UNAVAILABLE, 10, "the shard to show as down")

        def restart() -> bool:
            try:
                config = ServerConfig(shard_index=0, num_shards=1, num_workers=1, port=s.port, mode="async")
                start_cluster.start(config)
            except RuntimeError:  # the old socket is not released yet
                return False
            return True

        wait_until(restart, 10, f"port {s.port} to bind again")
        back = wait_until(
            lambda: (r := watcher.snapshot()[0]).ok and r.status.config.mode == ps_pb2.MODE_ASYNC, 30, "the restart"
        )
        assert back
    finally:
        watcher.close()


# ---------------------------------------------------------------------------------------- set
def test_set_changes_lr_and_mode_parameters_on_every_shard(training, wait_until) -> None:
    shards, trainer = training
    result = ps_admin(
        "--servers", servers_of(shards), "set", "--lr", "0.05", "--sync-quorum", "1", "--round-timeout", "30",
        "--max-staleness", "4", "--staleness-lr", "inverse", "--staleness", "3", "--moving-rate", "0.5",
        "--communication-period", "5",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    scheduled = r"scheduled at version (\d+) \(membership epoch \d+\); every shard applies it there"
    at = re.fullmatch(rf"{re.escape(shards[0].address)}  {scheduled}", lines[0])
    assert at and len(lines) == 2, lines
    # shard 0 chose its next round; every shard applied the change there, read back from GetStatus
    wait_until(lambda: all(st.applied_changes for st in statuses(shards)), 30, "the change on both shards")
    assert [[a.version for a in st.applied_changes] for st in statuses(shards)] == [[int(at[1])]] * 2
    for st, s in zip(statuses(shards), shards, strict=True):
        c = st.config
        assert (c.mode, c.learning_rate, c.sync_quorum, c.round_timeout_seconds) == (ps_pb2.MODE_SYNC, 0.05, 1, 30)
        assert (c.max_staleness, c.staleness_lr, c.staleness) == (4, "inverse", 3)
        assert (c.moving_rate, c.communication_period) == (0.5, 5)
        assert s.shard.learning_rate() == 0.05  # the optimizer itself, not only the report

    result = ps_admin("--servers", servers_of(shards), "set", "--mode", "ssp")
    assert result.returncode == 0, result.stderr
    wait_until(
        lambda: all(st.config.mode == ps_pb2.MODE_SSP and not st.pending_mode for st in statuses(shards)),
        30,
        "both shards to switch to ssp",
    )
    steps = trainer.steps
    wait_until(lambda: trainer.steps >= steps + 3 or trainer.error, 30, "3 more steps in ssp")
    assert trainer.error is None, trainer.error
    status = ps_admin("--servers", servers_of(shards), "status")
    assert status.returncode == 0 and "settings: lr 0.05, ssp staleness 3 clocks" in status.stdout.splitlines()


@pytest.mark.parametrize(
    "change, code, message",
    [
        (["--mode", "easgd"], 1, "INVALID_ARGUMENT: Cannot switch from sync to easgd live: "),
        (["--moving-rate", "1.5"], 1, "INVALID_ARGUMENT: --moving-rate must be in (0, 1], got 1.5."),
        (["--staleness", "-1"], 2, "argument --staleness: -1 is out of range"),
    ],
    ids=["sync-to-easgd", "moving-rate-1.5", "staleness-negative"],
)
def test_a_refused_set_changes_nothing(cluster, change, code, message) -> None:
    before = [st.config for st in statuses(cluster)]
    result = ps_admin("--servers", servers_of(cluster), "set", "--lr", "0.5", "--sync-quorum", "1", *change)
    assert result.returncode == code
    assert message in result.stderr and "Traceback" not in result.stderr
    if code == 1:  # the server's own message, on one line; shard 0 refused, so it scheduled nothing
        first = result.stderr.splitlines()[0]
        assert first.startswith(f"ps-admin: {cluster[0].address}: {message}")
        assert result.stderr.splitlines()[1] == "ps-admin: set: nothing changed."
        assert result.stdout.splitlines() == [f"{cluster[0].address}  failed (INVALID_ARGUMENT)"]
    assert [st.config for st in statuses(cluster)] == before


def test_a_set_goes_to_shard_0_alone(start_cluster) -> None:
    (s,) = start_cluster(1, num_workers=1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    # shard 0 schedules it; the others follow its record, so a shard down does not split the cluster
    result = ps_admin("--servers", f"{s.address},{dead}", "--timeout", "3", "set", "--sync-quorum", "1")
    assert result.returncode == 0, result.stderr
    lines = [line.split() for line in result.stdout.splitlines()]
    assert lines[0][:5] == [s.address, "scheduled", "at", "version", "0"]  # no rank is live: at once
    assert lines[1] == ["settings:", "lr", "-,", "sync", "quorum", "1", "of", "1,", "round", "timeout", "off"]
    down = ps_admin("--servers", f"{dead},{s.address}", "--timeout", "3", "set", "--sync-quorum", "1")
    assert down.returncode == 1 and down.stdout.split() == [dead, "failed", "(UNAVAILABLE)"]
    errors = down.stderr.splitlines()
    assert errors[0].startswith(f"ps-admin: {dead}: UNAVAILABLE: ") and errors[1] == "ps-admin: set: nothing changed."


def test_an_empty_set_is_a_usage_error() -> None:
    for env in ({}, {"PS_LR": "0.5", "PS_MODE": "async", "PS_STALENESS": "2"}):  # other commands' twins
        result = ps_admin("--servers", "127.0.0.1:1", "set", env=env)
        assert result.returncode == 2
        assert "ps-admin set: error: set needs at least one change: --lr, --mode," in result.stderr


# ---------------------------------------------------------------------------------------- evict
def test_evict_lets_a_waiting_sync_round_go_on(waiting_round) -> None:
    shards, pulled = waiting_round
    status = ps_admin("--servers", servers_of(shards), "status").stdout
    rank1 = [line.split() for line in status.splitlines() if line.split()[:2] == ["1", "pending"]]
    assert rank1 and rank1[0][5] == "missing", status  # RANK STATE CLOCK PUSHES SEEN ROUND
    result = ps_admin("--servers", servers_of(shards), "evict", "1")
    assert result.returncode == 0, result.stderr
    # shard 0 decides; shard 1 follows the record the waiting worker relays
    assert result.stdout.splitlines() == [f"{shards[0].address}  rank 1 pending -> evicted (version 1)"]
    assert pulled.result(timeout=RPC_TIMEOUT) == 1
    for st in statuses(shards):
        assert st.version == 1 and [w.state for w in st.workers][1] == ps_pb2.WORKER_STATE_EVICTED
    again = ps_admin("--servers", servers_of(shards), "evict", "1")
    assert again.returncode == 0 and "rank 1 already evicted" in again.stdout
    out_of_range = ps_admin("--servers", servers_of(shards), "evict", "7")
    assert out_of_range.returncode == 1
    assert f"ps-admin: {shards[0].address}: INVALID_ARGUMENT: Rank 7 is out of range" in out_of_range.stderr


def test_a_mode_switch_waits_for_the_round_boundary(waiting_round, wait_until) -> None:
    shards, pulled = waiting_round
    result = ps_admin("--servers", servers_of(shards), "set", "--mode", "async", "--max-staleness", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-2:] == [
        "settings: lr 0.1, sync quorum all, round timeout off",
        "pending: async at the next round boundary (max staleness 8, staleness lr constant)",
    ]
    wait_until(  # shard 1 learns it from the record the waiting worker relays
        lambda: all(
            st.config.mode == ps_pb2.MODE_SYNC and st.pending_mode == ps_pb2.MODE_ASYNC for st in statuses(shards)
        ),
        10,
        "the pending switch on both shards",
    )
    report = json.loads(ps_admin("--servers", servers_of(shards), "status", "--json").stdout)
    assert [sh["pending_mode"] for sh in report["shards"]] == ["async", "async"]
    assert ps_admin("--servers", servers_of(shards), "evict", "1").returncode == 0
    assert pulled.result(timeout=RPC_TIMEOUT) == 1
    wait_until(lambda: all(st.config.mode == ps_pb2.MODE_ASYNC for st in statuses(shards)), 10, "the switch")


# ---------------------------------------------------------------------------------------- checkpoint
def test_checkpoint_on_every_shard_and_a_refusal_with_the_shards_message(
    start_cluster, start_trainer, wait_until, tmp_path
) -> None:
    shards = start_cluster(2, num_workers=1, checkpoint_dir=str(tmp_path / "ckpt"))
    trainer = start_trainer([s.address for s in shards], pace=0.05)
    wait_until(lambda: trainer.steps >= 3 or trainer.error, 30, "3 training steps")
    result = ps_admin("--servers", servers_of(shards), "checkpoint")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and result.stderr == ""
    for s, line in zip(shards, lines, strict=True):
        match = re.fullmatch(rf"{re.escape(s.address)}  version (\d+) written in (\d+\.\d{{3}}) s: (\S+)", line)
        assert match, line
        version, path = int(match[1]), match[3]
        assert version >= 3 and os.path.isfile(path) and path.startswith(str(tmp_path / "ckpt"))
        assert statuses([s])[0].last_checkpoint_version >= version

    (bare,) = start_cluster(1, num_workers=1)  # no --checkpoint-dir
    mixed = ps_admin("--servers", f"{shards[0].address},{bare.address}", "checkpoint")
    assert mixed.returncode == 1
    out = mixed.stdout.splitlines()
    assert out[0].startswith(f"{shards[0].address}  version ")
    assert out[1].split() == [bare.address, "failed", "(FAILED_PRECONDITION)"]
    assert mixed.stderr.splitlines() == [
        f"ps-admin: {bare.address}: FAILED_PRECONDITION: This shard has no --checkpoint-dir; restart it with one "
        "to checkpoint."
    ]


# ---------------------------------------------------------------------------------------- tokens
def test_set_evict_and_top_take_the_admin_token_only(start_cluster) -> None:
    (s,) = start_cluster(1, num_workers=2, token="worker-secret", admin_token="admin-secret")
    denied = (
        f"ps-admin: {s.address}: PERMISSION_DENIED: /ps.v1.Admin/{{}} needs the admin token (PS_ADMIN_TOKEN); "
        "the worker token may not call Admin. (Admin needs the admin token (PS_ADMIN_TOKEN), not the worker token)"
    )
    for command, method in (
        (["set", "--sync-quorum", "1"], "UpdateConfig"),
        (["evict", "1"], "EvictWorker"),
        (["checkpoint"], "Checkpoint"),
    ):
        worker = ps_admin("--servers", s.address, "--admin-token", "worker-secret", *command)
        assert worker.returncode == 1 and worker.stderr.splitlines()[0] == denied.format(method)
        none = ps_admin("--servers", s.address, *command)
        assert none.returncode == 1 and f"UNAUTHENTICATED: /ps.v1.Admin/{method} needs" in none.stderr
        assert "Traceback" not in worker.stderr + none.stderr
    top = ps_admin("--servers", s.address, "--admin-token", "worker-secret", "top", "--iterations", "3")
    assert top.returncode == 1 and top.stderr.splitlines() == [denied.format("WatchStatus")]
    assert statuses([s], token="admin-secret")[0].config.sync_quorum == 0  # nothing changed
    assert (
        ps_admin("--servers", s.address, "set", "--sync-quorum", "1", env={"PS_ADMIN_TOKEN": "admin-secret"}).returncode
        == 0
    )
    evicted = ps_admin("--servers", s.address, "--admin-token", "admin-secret", "evict", "1")
    assert evicted.returncode == 0 and "rank 1 pending -> evicted" in evicted.stdout
    st = statuses([s], token="admin-secret")[0]
    assert st.config.sync_quorum == 1 and st.workers[1].state == ps_pb2.WORKER_STATE_EVICTED
