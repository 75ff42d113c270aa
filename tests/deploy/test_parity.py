"""The deployment files run as written: compose services and Kubernetes pods as local processes.

Each test reads the commands and environments from docker-compose.yml (through ``docker-compose
config``) or from the rendered deploy/k8s manifests, with the images' ENTRYPOINT/CMD/ENV from
deploy/docker, runs them on 127.0.0.1 (see localrun.localize for the only changes) and trains
digits to at least 0.95 held-out accuracy. So a renamed flag, a wrong variable, a port that does
not match or a broken health check fails here before it fails in a cluster.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from deploy_tools import require_tool
from deployment import (
    ENTRYPOINT_ENV,
    REPO,
    Process,
    compose_config,
    compose_processes,
    help_env_names,
    image_by_name,
    k8s_processes,
    read_env_file,
    run_tool,
)
from localrun import LISTENING, Running, localize, wait_until_healthy

DONE = re.compile(r'^\{.*"event": "done"')
IDLING = re.compile(r"training finished; idling")
MIN_ACCURACY = 0.95
DEADLINE_SECONDS = 300.0


def _deadline_left(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    assert left > 0, f"out of time before {what}"
    return left


def run_cluster(
    processes: list[Process],
    workdir: Path,
    workers_idle_after_training: bool,
    after_training: Callable[[dict[str, str]], None] | None = None,
) -> list[dict[str, Any]]:
    """Start the shards, wait for their health checks, run the workers to the end, stop the shards.

    Args:
        processes: resolved services or pods (shards run ps-server, workers ps-worker).
        workdir: a private directory for logs, HOME and checkpoints.
        workers_idle_after_training: Kubernetes workers stay up after training (see
            deploy/k8s/worker-statefulset.yaml); compose workers exit.
        after_training: called with every shard's names -> its local address once the workers are
            done, before the shards stop.

    Returns:
        Each worker's JSON summary.
    """
    server_env, worker_env = help_env_names("ps-server"), help_env_names("ps-worker") | ENTRYPOINT_ENV
    servers = [p for p in processes if p.image.command_name == "ps-server"]
    workers = [p for p in processes if p.image.command_name == "ps-worker"]
    assert len(servers) + len(workers) == len(processes), [p.argv for p in processes]
    assert {p.env["PS_NUM_SHARDS"] for p in servers} == {str(len(servers))}, "PS_NUM_SHARDS != number of shards"
    assert {p.env["PS_NUM_WORKERS"] for p in processes} == {str(len(workers))}, "PS_NUM_WORKERS != number of workers"
    deadline = time.monotonic() + DEADLINE_SECONDS
    started: list[tuple[Process, Running]] = []
    try:
        for process in servers:
            env = localize(process, server_env, worker_env, {}, {}, workdir / process.name)
            started.append((process, Running(process.name, process.argv, env, workdir / process.name)))
        addresses: dict[str, str] = {}
        deploy_ports: dict[str, str] = {}
        for process, run in started:
            address = run.wait_for_line(LISTENING, _deadline_left(deadline, f"{process.name} listens")).group(1)
            port = address.rpartition(":")[2]
            assert process.health_argv, f"{process.name} has no health check"
            deploy_port = process.env["PS_PORT"]
            health = [a.replace(f"127.0.0.1:{deploy_port}", f"127.0.0.1:{port}") for a in process.health_argv]
            # The check runs inside the container, in its environment (PS_PORT is the port it serves).
            wait_until_healthy(health, {**run.env, "PS_PORT": port}, 60.0, process.name)
            for name in process.names:
                addresses[name] = address
                deploy_ports[name] = deploy_port
        worker_runs = []
        for process in workers:
            env = localize(process, worker_env, server_env, addresses, deploy_ports, workdir / process.name)
            run = Running(process.name, process.argv, env, workdir / process.name)
            started.append((process, run))
            worker_runs.append((process, run))
        summaries = []
        for process, run in worker_runs:
            if workers_idle_after_training:
                run.wait_for_line(DONE, _deadline_left(deadline, f"{process.name} finishes"))
                run.wait_for_line(IDLING, _deadline_left(deadline, f"{process.name} idles"), stream="stderr")
                assert run.popen.poll() is None, f"{process.name} exited instead of idling\n{run.tail()}"
                os.kill(run.popen.pid, signal.SIGTERM)  # what the kubelet sends the container's PID 1
                code = run.popen.wait(timeout=process.stop_grace_seconds)
                assert code == 0, f"{process.name}: SIGTERM while idle exited {code}\n{run.tail()}"
                assert run.wait_group_gone(5.0), f"{process.name} left a process behind"
            else:
                code = run.popen.wait(timeout=_deadline_left(deadline, f"{process.name} exits"))
                assert code == 0, f"{process.name} exited {code}\n{run.tail()}"
            summary = run.summary()
            assert summary["accuracy"] >= MIN_ACCURACY, f"{process.name}: {summary}"
            summaries.append(summary)
        # ps-worker reports its parameters' sha256; a user's script (examples/cnn_digits.py) its accuracy
        same = "params_sha256" if all("params_sha256" in s for s in summaries) else "accuracy"
        assert len({s[same] for s in summaries}) == 1, f"sync workers ended with different {same}: {summaries}"
        (steps,) = {int(p.env["PS_STEPS"]) for p in workers}
        if after_training is not None:
            after_training(addresses)
        for process in servers:
            check_admin_status(process, addresses[min(process.names)], steps)
        for process, run in started[: len(servers)]:
            os.kill(run.popen.pid, signal.SIGTERM)  # docker stop / pod deletion
            code = run.popen.wait(timeout=process.stop_grace_seconds)
            assert code == 0, f"{process.name}: SIGTERM exited {code} within its grace period\n{run.tail()}"
        return summaries
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"timed out: {exc}\n" + "\n".join(run.tail() for _, run in started)) from exc
    finally:
        for _, run in started:
            run.end()


def check_admin_status(process: Process, address: str, steps: int) -> None:
    """deploy/README.md's grpcurl call works with the deployment's admin token, and not without it."""
    grpcurl = require_tool("grpcurl")
    token = process.env["PS_ADMIN_TOKEN"]
    call = [grpcurl, "-plaintext", "-max-time", "20", address, "ps.v1.Admin/GetStatus"]
    done = run_tool([*call[:2], "-H", f"authorization: Bearer {token}", *call[2:]], timeout=60)
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)["status"]
    # grpcurl prints proto field names; proto3 JSON leaves out zeros.
    assert status.get("shard_index", 0) == int(process.env["PS_SHARD_INDEX"]), status
    assert int(status["version"]) == steps, status
    refused = run_tool(call, timeout=60)
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr, refused.stderr


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_SECONDS + 120)
def test_compose_up_trains_digits(compose_model: dict[str, Any], tmp_path: Path) -> None:
    profiles = set(read_env_file(REPO / ".env.example").get("COMPOSE_PROFILES", "").split(","))
    processes = compose_processes(compose_model, profiles)
    assert sorted(p.name for p in processes) == ["ps-0", "ps-1", "worker-0", "worker-1"]
    summaries = run_cluster(processes, tmp_path, workers_idle_after_training=False)
    assert sorted(s["rank"] for s in summaries) == [0, 1]


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_SECONDS + 120)
def test_kubectl_apply_trains_digits(
    rendered_k8s: list[dict[str, Any]], compose_model: dict[str, Any], tmp_path: Path
) -> None:
    processes = k8s_processes(rendered_k8s, image_by_name(compose_model))
    assert sorted(p.name for p in processes) == ["ps-0", "ps-1", "worker-0", "worker-1"]
    summaries = run_cluster(processes, tmp_path, workers_idle_after_training=True)
    assert sorted(s["rank"] for s in summaries) == [0, 1]


USER_SCRIPT = REPO / "examples" / "cnn_digits.py"
IN_CONTAINER = "/opt/grpc-ps-user/train.py"


def run_user_script_from(processes: list[Process], script: Path) -> None:
    """Point the workers' PS_SCRIPT, a path inside the container, at the local file mounted there."""
    workers = [p for p in processes if p.image.command_name == "ps-worker"]
    assert workers and all(p.env.get("PS_SCRIPT") == IN_CONTAINER for p in workers)
    for p in workers:
        p.env["PS_SCRIPT"] = str(script)


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_SECONDS + 120)
def test_compose_override_runs_the_user_script(docker_compose: str, tmp_path: Path) -> None:
    override = REPO / "deploy" / "compose" / "user-script.yml"
    env = {"PATH": os.environ["PATH"], "PS_USER_SCRIPT": "./examples/cnn_digits.py"}
    model = compose_config(docker_compose, REPO / ".env.example", (override,), env=env)
    profiles = set(read_env_file(REPO / ".env.example").get("COMPOSE_PROFILES", "").split(","))
    processes = compose_processes(model, profiles)
    for name in ("worker-0", "worker-1"):
        assert model["services"][name]["volumes"] == [f"{USER_SCRIPT}:{IN_CONTAINER}:ro"]
    run_user_script_from(processes, USER_SCRIPT)
    summaries = run_cluster(processes, tmp_path, workers_idle_after_training=False)
    assert sorted(s["rank"] for s in summaries) == [0, 1]


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_SECONDS + 120)
def test_kubectl_apply_user_script_overlay_runs_the_script(
    rendered_user_script: list[dict[str, Any]], compose_model: dict[str, Any], tmp_path: Path
) -> None:
    (config_map,) = [r for r in rendered_user_script if r["metadata"]["name"].startswith("grpc-ps-user-script-")]
    script = tmp_path / "mounted" / "train.py"  # what the pods see at /opt/grpc-ps-user
    script.parent.mkdir()
    script.write_text(config_map["data"]["train.py"])
    processes = k8s_processes(rendered_user_script, image_by_name(compose_model))
    run_user_script_from(processes, script)
    summaries = run_cluster(processes, tmp_path, workers_idle_after_training=True)
    assert sorted(s["rank"] for s in summaries) == [0, 1]
