"""``docker compose up`` of docker-compose.yml, for real: a Docker engine, the images, containers.

Needs the engine and images that ``deploy/local-engine.sh up`` prepares (``.ci/run`` runs it and
exports its ``engine.env``: ``GRPC_PS_ENGINE=1``, ``GRPC_PS_DOCKER``, ``GRPC_PS_COMPOSE``). Without
them the tests are skipped, saying so, except under CI, where they fail.

The compose file runs as written, with one override (``.ci/docker-compose.ci.yml``: Prometheus from
a locally built image), its host ports moved to free ones through ``PS_0_PORT``, ``PS_1_PORT`` and
``PROMETHEUS_PORT``, and a project name of its own, so it collides with nothing on a shared host.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from deployment import REPO

ENGINE_HINT = "run `deploy/local-engine.sh up` and export its engine.env (.ci/run does both)"
MIN_ACCURACY = 0.95
"""A shard killed with no checkpoint comes back empty; rank 0 writes its current values again and the
shard's momentum starts over (docs/faults.md): the chaos soak's bar for runs through shard crashes."""
STEPS = 300
SHARDS = ("ps-0", "ps-1")
WORKERS = ("worker-0", "worker-1")
CHECKPOINT_DIR = "/var/lib/grpc-ps/checkpoints"
# Bounds, generous for two shared cores: every wait below polls against one of these.
UP_TIMEOUT = 600.0
TRAIN_TIMEOUT = 900.0
COMMAND_TIMEOUT = 180.0

# pyproject's 300 s per test is too short for an up, a training run and a down on two busy cores.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _engine() -> tuple[str, str]:
    """(docker, docker-compose) of the prepared engine; skips (fails under CI) without one."""
    docker, compose = os.environ.get("GRPC_PS_DOCKER", ""), os.environ.get("GRPC_PS_COMPOSE", "")
    problem = ""
    if os.environ.get("GRPC_PS_ENGINE") != "1":
        problem = "no Docker engine prepared for the compose test (GRPC_PS_ENGINE is not 1)"
    elif not (docker and os.access(docker, os.X_OK) and compose and os.access(compose, os.X_OK)):
        problem = f"GRPC_PS_DOCKER={docker!r} or GRPC_PS_COMPOSE={compose!r} is not an executable"
    if problem:
        message = f"{problem}: {ENGINE_HINT}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return docker, compose


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _strict_json(line: str) -> dict[str, Any]:
    """``line`` parsed as strict JSON: NaN and Infinity are errors."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant} in {line}")

    return json.loads(line, parse_constant=refuse)


class Compose:
    """One compose project of docker-compose.yml + the CI override, driven by docker-compose."""

    def __init__(self, docker: str, compose: str, workdir: Path, overrides: tuple[Path, ...] = (), **env: str) -> None:
        self.docker, self.compose = docker, compose
        self.project = f"grpc-ps-ci-{secrets.token_hex(4)}"
        self.prometheus_port = _free_port()
        env_file = workdir / "compose.env"
        env_file.write_text("COMPOSE_PROFILES=cpu\n")
        self.env = {
            **os.environ,
            "COMPOSE_PROFILES": "cpu",
            "PS_TOKEN": secrets.token_urlsafe(24),
            "PS_ADMIN_TOKEN": secrets.token_urlsafe(24),
            "PS_0_PORT": str(_free_port()),
            "PS_1_PORT": str(_free_port()),
            "PS_2_PORT": str(_free_port()),  # deploy/compose/three-shards.yml
            "PROMETHEUS_PORT": str(self.prometheus_port),
            "COMPOSE_HTTP_TIMEOUT": "300",
            **env,
        }
        self.env_file, self.overrides, self.shards = env_file, overrides, SHARDS

    @property
    def base(self) -> list[str]:
        return [
            self.compose,
            "--project-name",
            self.project,
            "--project-directory",
            str(REPO),
            "--env-file",
            str(self.env_file),
            "-f",
            str(REPO / "docker-compose.yml"),
            "-f",
            str(REPO / ".ci" / "docker-compose.ci.yml"),
            *(arg for path in self.overrides for arg in ("-f", str(path))),
        ]

    def run(self, *args: str, timeout: float = COMMAND_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [*self.base, *args], env=self.env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        if check:
            assert done.returncode == 0, f"docker-compose {' '.join(args)}: exit {done.returncode}\n{done.stderr}"
        return done

    def docker_cmd(self, *args: str, timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.docker, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def container(self, service: str) -> str:
        done = self.run("ps", "-q", service)
        ids = done.stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def inspect(self, service: str) -> dict[str, Any]:
        done = self.docker_cmd("inspect", self.container(service))
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)[0]

    def logs(self, service: str) -> str:
        done = self.docker_cmd("logs", self.container(service))
        return done.stdout + done.stderr

    def stdout_lines(self, service: str) -> list[str]:
        done = self.docker_cmd("logs", self.container(service))
        return done.stdout.splitlines()

    def all_logs(self) -> str:
        """Every container's state and last lines: what a failure prints."""
        parts = [self.run("ps", check=False).stdout]
        for service in (*self.shards, *WORKERS, "prometheus"):
            try:
                state = self.inspect(service)["State"]
                logs = self.logs(service).splitlines()[-40:]
            except (AssertionError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
                parts.append(f"--- {service}: {exc}")
                continue
            health = state.get("Health", {}).get("Status")
            parts.append(f"--- {service}: {state['Status']} exit {state['ExitCode']} health {health}")
            parts.extend(logs)
        return "\n".join(parts)

    def wait(self, what: str, predicate: Any, timeout: float, interval: float = 1.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            result = predicate()
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.all_logs()}")
            time.sleep(interval)

    def shard_version(self, service: str) -> int:
        """ps_model_version from the shard's own /metrics (inside its container)."""
        code = (
            "import urllib.request as u\n"
            "for line in u.urlopen('http://127.0.0.1:8000/metrics', timeout=5).read().decode().splitlines():\n"
            "    if line.startswith('ps_model_version '): print(int(float(line.split()[1])))\n"
        )
        done = self.docker_cmd("exec", self.container(service), "python", "-c", code, timeout=30)
        return int(done.stdout.strip() or -1) if done.returncode == 0 else -1

    def prometheus(self, query: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.prometheus_port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.load(response)["data"]["result"]
        except OSError:
            return []

    def down(self) -> None:
        self.run("down", "-v", "--remove-orphans", "--timeout", "30", timeout=300, check=False)


@pytest.fixture
def compose(tmp_path: Path) -> Iterator[Compose]:
    docker, compose_bin = _engine()
    project = Compose(docker, compose_bin, tmp_path)
    try:
        yield project
    finally:
        project.down()


@pytest.fixture
def compose_user_script(tmp_path: Path) -> Iterator[Compose]:
    """The project with deploy/compose/user-script.yml on top, running examples/cnn_digits.py."""
    docker, compose_bin = _engine()
    override = REPO / "deploy" / "compose" / "user-script.yml"
    project = Compose(docker, compose_bin, tmp_path, (override,), PS_USER_SCRIPT="./examples/cnn_digits.py")
    try:
        yield project
    finally:
        project.down()


def _healthy(project: Compose, service: str) -> bool:
    return project.inspect(service)["State"].get("Health", {}).get("Status") == "healthy"


def _workers_exited(project: Compose) -> dict[str, int] | None:
    codes = {}
    for service in WORKERS:
        state = project.inspect(service)["State"]
        if state["Status"] != "exited":
            return None
        codes[service] = state["ExitCode"]
    return codes


def _check_trained(project: Compose, min_accuracy: float = MIN_ACCURACY) -> list[dict[str, Any]]:
    """Both workers exited 0, each with a strict-JSON summary and held-out accuracy >= ``min_accuracy``."""
    codes = project.wait("both workers to exit", lambda: _workers_exited(project), TRAIN_TIMEOUT, interval=2.0)
    assert codes == {w: 0 for w in WORKERS}, f"worker exit codes {codes}\n{project.all_logs()}"
    summaries = []
    for service in WORKERS:
        lines = [line for line in project.stdout_lines(service) if line.startswith("{")]
        assert lines, f"{service}: no JSON on stdout\n{project.all_logs()}"
        summary = _strict_json(lines[-1])
        assert summary.get("event") == "done", f"{service}: last JSON line is not the summary: {summary}"
        assert isinstance(summary["accuracy"], float) and math.isfinite(summary["accuracy"])
        assert summary["accuracy"] >= min_accuracy, f"{service}: {summary}"
        summaries.append(summary)
    for service in SHARDS:  # a restarted shard may still be in its start period
        project.wait(f"{service} healthy after training", lambda s=service: _healthy(project, s), 120.0)
    return summaries


def test_compose_up_trains_digits_in_containers(compose: Compose) -> None:
    """up: shards healthy, workers exit 0 with >= 0.95 accuracy, Prometheus scraped all four,
    and the shards' checkpoints are on their named volumes after a stop; after down (volumes
    kept) and up, the finished job has nothing to do and says so."""
    started = time.monotonic()
    compose.run("up", "-d", "--no-build", timeout=UP_TIMEOUT)
    for service in SHARDS:
        compose.wait(f"{service} healthy", lambda s=service: _healthy(compose, s), UP_TIMEOUT)
    summaries = _check_trained(compose)
    trained = time.monotonic() - started

    targets = {f"{name}:8000" for name in (*SHARDS, *WORKERS)}

    def scraped() -> bool:
        results = compose.prometheus("max_over_time(up[1h])")
        return {r["metric"].get("instance") for r in results if r["value"][1] == "1"} >= targets

    compose.wait(f"Prometheus to have scraped {sorted(targets)}", scraped, 60.0, interval=2.0)
    versions = compose.prometheus("max_over_time(ps_model_version[1h])")
    assert {r["metric"]["instance"] for r in versions} >= {f"{s}:8000" for s in SHARDS}, versions

    # A shard writes its checkpoint on SIGTERM (docker stop), into its named volume.
    compose.run("stop", "--timeout", "30", *SHARDS, timeout=COMMAND_TIMEOUT)
    for service in SHARDS:
        info = compose.inspect(service)
        assert info["State"]["ExitCode"] == 0, f"{service} exited {info['State']['ExitCode']}\n{compose.all_logs()}"
        (volume,) = [m["Name"] for m in info["Mounts"] if m["Destination"] == CHECKPOINT_DIR and m["Type"] == "volume"]
        assert volume.endswith(f"_{service}-checkpoints"), volume
        listing = compose.docker_cmd(
            "run", "--rm", "--network", "none", "-v", f"{volume}:/c:ro", "--entrypoint", "find",
            "grpc-ps-server:0.1.0", "/c", "-type", "f", "-size", "+0",
        )  # fmt: skip
        assert listing.returncode == 0, listing.stderr
        assert listing.stdout.split(), f"{service}: no checkpoint in volume {volume}\n{compose.all_logs()}"
    print(f"compose up: trained in {trained:.0f} s; accuracies {[s['accuracy'] for s in summaries]}")

    # down without -v, then up: the shards resume at the finished job's version from their volumes,
    # and the workers say there is nothing to do, exiting 0 with a strict-JSON summary (null loss).
    compose.run("down", "--timeout", "30", timeout=300)
    compose.run("up", "-d", "--no-build", timeout=UP_TIMEOUT)
    for summary in _check_trained(compose):
        assert summary.get("final_loss") is None, summary
    for service in WORKERS:
        assert "nothing to do" in compose.logs(service), f"{service}\n{compose.all_logs()}"


def test_compose_up_survives_a_killed_shard(compose: Compose) -> None:
    """up, then SIGKILL ps-1's process mid-run, after its first periodic checkpoint (PS_CHECKPOINT_EVERY):
    restart: unless-stopped brings it back, it loads that checkpoint, and the job completes."""
    compose.run("up", "-d", "--no-build", timeout=UP_TIMEOUT)
    compose.wait(
        "ps-1's first periodic checkpoint",
        lambda: "shard 1: checkpoint at version" in compose.logs("ps-1"),
        TRAIN_TIMEOUT,
        interval=0.5,
    )
    version = compose.shard_version("ps-1")
    assert version < STEPS, f"training ended (version {version}) before ps-1 could be killed mid-run"
    pid = compose.inspect("ps-1")["State"]["Pid"]
    assert pid > 0
    os.kill(pid, signal.SIGKILL)  # a crash, not `docker kill` (which counts as a manual stop)
    compose.wait(
        "ps-1 restarted by its restart policy",
        lambda: (s := compose.inspect("ps-1"))["RestartCount"] >= 1 and s["State"]["Status"] == "running",
        120.0,
    )
    summaries = _check_trained(compose)
    logs = compose.logs("ps-1")
    loaded = re.search(r"Loaded checkpoint of shard 1 at version (\d+)", logs)
    assert loaded, f"ps-1 did not resume from a checkpoint\n{compose.all_logs()}"
    # the newest periodic checkpoint its first process wrote (one may land between the read of
    # `version` above and the SIGKILL, so `version` is a lower bound, not the answer)
    written = [int(v) for v in re.findall(r"shard 1: checkpoint at version (\d+) written", logs[: loaded.start()])]
    assert written and int(loaded.group(1)) == max(written) > 0, (
        f"ps-1 resumed at version {loaded.group(1)}, not at its newest checkpoint {written[-1:]}\n{compose.all_logs()}"
    )
    accuracies = [s["accuracy"] for s in summaries]
    print(f"killed ps-1 at version {version}, resumed at {loaded.group(1)}; accuracies {accuracies}")


RESHARD_FIRST_STEPS = 120


def test_compose_job_resharded_from_two_shards_onto_three(compose: Compose, tmp_path: Path) -> None:
    """A 2-shard job stops at step 120 (down, volumes kept); deploy/compose/reshard.sh moves its
    checkpoints onto 3 volumes; up with deploy/compose/three-shards.yml: every shard resumes from the
    resharded version, the workers resume at the cluster's clock and finish the 300 steps with
    >= 0.95 accuracy, and the 3 shards end at version 300."""
    started = time.monotonic()
    short = tmp_path / "short-run.yml"
    short.write_text(
        "services:\n" + "".join(f"  {w}:\n    environment:\n      PS_STEPS: '{RESHARD_FIRST_STEPS}'\n" for w in WORKERS)
    )
    compose.overrides = (short,)
    compose.run("up", "-d", "--no-build", timeout=UP_TIMEOUT)
    _check_trained(compose)
    versions = {s: compose.shard_version(s) for s in SHARDS}
    assert versions == dict.fromkeys(SHARDS, RESHARD_FIRST_STEPS), versions  # sync: one version per step
    script = [
        "bash",
        str(REPO / "deploy" / "compose" / "reshard.sh"),
        "-p",
        compose.project,
        "--from",
        "2",
        "--to",
        "3",
    ]
    env = {**compose.env, "DOCKER": compose.docker}
    refused = subprocess.run(script, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert refused.returncode == 1 and "stop the job first" in refused.stderr, refused.stdout + refused.stderr
    compose.run("down", "--timeout", "30", timeout=300)  # each shard writes its final checkpoint

    compose.overrides, compose.shards = (REPO / "deploy" / "compose" / "three-shards.yml",), ("ps-0", "ps-1", "ps-2")
    reshard = subprocess.run(script, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert reshard.returncode == 0, reshard.stdout + reshard.stderr
    version = RESHARD_FIRST_STEPS
    assert f"reshard.sh: version {version} of 2 shards is now on 3 shards" in reshard.stdout, reshard.stdout
    listing = compose.docker_cmd(
        "run", "--rm", "--network", "none", "-v", f"{compose.project}_ps-0-checkpoints:/c:ro", "--entrypoint", "find",
        "grpc-ps-server:0.1.0", "/c", "-name", "*.pt",
    )  # fmt: skip
    files = {path.removeprefix("/c/").split("-v")[0] for path in listing.stdout.split()}
    assert files == {"shard-0", "before-reshard"}, listing.stdout + listing.stderr  # the 2-shard file kept aside
    resharded = time.monotonic() - started

    compose.run("up", "-d", "--no-build", timeout=UP_TIMEOUT)
    summaries = _check_trained(compose)
    for summary in summaries:
        assert (summary["first_step"], summary["steps"]) == (RESHARD_FIRST_STEPS, STEPS), summary
    for service in compose.shards:
        compose.wait(f"{service} healthy", lambda s=service: _healthy(compose, s), 120.0)
        line = f"ps-server: shard {service[-1]} resumed from its checkpoint at version {version}"
        assert line in compose.logs(service), f"{service}\n{compose.all_logs()}"
    final = {s: compose.shard_version(s) for s in compose.shards}
    assert final == dict.fromkeys(compose.shards, STEPS), final
    print(
        f"reshard 2 -> 3 at version {version} after {resharded:.0f} s; versions {final}; "
        f"accuracies {[s['accuracy'] for s in summaries]}; {time.monotonic() - started:.0f} s in all"
    )


def test_compose_user_script_override_trains_and_the_model_is_exported(
    compose_user_script: Compose, tmp_path: Path
) -> None:
    """The override runs examples/cnn_digits.py in the worker containers (image unchanged); once both
    exited, `ps-admin export` on the host writes the model, which loads into the example's CNN and
    scores the accuracy the workers reported (sync: both ranks end on the same weights and buffers)."""
    import runpy

    import torch

    project = compose_user_script
    project.run("up", "-d", "--no-build", timeout=UP_TIMEOUT)
    summaries = _check_trained(project)
    assert {s["accuracy"] for s in summaries} == {summaries[0]["accuracy"]}, summaries
    # from the host, through the ports compose publishes on 127.0.0.1, as docs/user-script-deploy.md says
    servers = f"127.0.0.1:{project.env['PS_0_PORT']},127.0.0.1:{project.env['PS_1_PORT']}"
    token = project.env["PS_ADMIN_TOKEN"]  # token_urlsafe may begin with "-": --admin-token=TOKEN
    export = [sys.executable, "-m", "ps_admin.cli", "--servers", servers, f"--admin-token={token}"]
    done = subprocess.run(
        [*export, "export", "--out", str(tmp_path / "model.pt")],
        capture_output=True, text=True, timeout=COMMAND_TIMEOUT, cwd=REPO, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr + project.all_logs()
    example = runpy.run_path(str(REPO / "examples" / "cnn_digits.py"))  # its model and its held-out split
    model = example["cnn"](16)
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    _, x_test, _, y_test = train_test_split(x, torch.tensor(y), test_size=0.2, random_state=0, stratify=y)
    model.eval()
    with torch.no_grad():
        accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    assert accuracy == summaries[0]["accuracy"], (accuracy, summaries)


def test_bring_your_own_image_runs_the_copied_script_with_its_args(tmp_path: Path) -> None:
    """deploy/docker/examples/user.Dockerfile on top of the built worker image: the script it
    copies runs as the container's process, with the arguments after the image."""
    docker, _ = _engine()
    (tmp_path / "train.py").write_text("import os, sys\nprint(sys.argv[1:], os.environ['PS_RANK'], os.getpid())\n")
    tag = f"grpc-ps-ci-user:{secrets.token_hex(4)}"
    dockerfile = REPO / "deploy" / "docker" / "examples" / "user.Dockerfile"
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    try:
        built = subprocess.run(
            [docker, "build", "--network", "none", "-f", str(dockerfile), "-t", tag, str(tmp_path)],
            capture_output=True, text=True, timeout=COMMAND_TIMEOUT, env=env, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr
        ran = subprocess.run(
            [docker, "run", "--rm", "--network", "none", "--read-only", "-e", "PS_RANK=1", tag, "--epochs", "3"],
            capture_output=True, text=True, timeout=COMMAND_TIMEOUT, env=env, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.strip() == "['--epochs', '3'] 1 1", "the script must be PID 1 (exec), with its args"
    finally:
        subprocess.run([docker, "rmi", "-f", tag], capture_output=True, timeout=COMMAND_TIMEOUT, env=env)
