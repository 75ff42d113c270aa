"""deploy/docker: hadolint clean, and the properties the images promise."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_tools import require_tool
from deployment import REPO, parse_dockerfile, run_tool

from ps_common.process_env import GLIBC_TUNABLES

DOCKERFILES = sorted((REPO / "deploy" / "docker").glob("*.Dockerfile"))


def test_the_three_images_exist() -> None:
    assert [p.name for p in DOCKERFILES] == ["server.Dockerfile", "worker-gpu.Dockerfile", "worker.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile: Path) -> None:
    hadolint = require_tool("hadolint")
    done = run_tool([hadolint, "--no-color", str(dockerfile)], timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_final_stage_runs_non_root_with_tuned_malloc(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    final_stage = text[text.rindex("\nFROM ") :]
    users = [line.split()[1] for line in final_stage.splitlines() if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] == "10001", "the last USER must be the numeric non-root uid 10001"
    image = parse_dockerfile(dockerfile)
    assert image.env["GLIBC_TUNABLES"] == GLIBC_TUNABLES
    assert image.env["PYTHONUNBUFFERED"] == "1", "logs and the worker's JSON summary must not sit in a buffer"


def test_cpu_images_pin_cpu_torch_and_build_in_two_stages() -> None:
    for name in ("server.Dockerfile", "worker.Dockerfile"):
        text = (REPO / "deploy" / "docker" / name).read_text()
        assert "ARG TORCH_VERSION=2.13.0" in text
        assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
        assert text.count("\nFROM ") == 2 and "COPY --from=build /opt/grpc-ps /opt/grpc-ps" in text


def test_entrypoints_and_health_checks() -> None:
    server = parse_dockerfile(REPO / "deploy" / "docker" / "server.Dockerfile")
    assert server.entrypoint == ["ps-server"] and server.cmd == []
    assert server.env["PS_HOST"] == "0.0.0.0" and server.env["PS_PORT"] == "50051"
    assert server.env["PS_DATA_PORT"] == "50052"
    assert 'CMD ["python", "-m", "ps_server.healthcheck"]' in server.dockerfile.read_text()
    for name, device in (("worker.Dockerfile", "cpu"), ("worker-gpu.Dockerfile", "cuda")):
        worker = parse_dockerfile(REPO / "deploy" / "docker" / name)
        # No CMD: a CMD workload would override PS_WORKLOAD.
        # ps-worker, or the user's script when one is named (ps_worker.entrypoint)
        assert worker.entrypoint == ["python", "-m", "ps_worker.entrypoint"] and worker.cmd == []
        assert worker.env["PS_DEVICE"] == device


def test_dockerignore_is_an_allowlist() -> None:
    lines = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line[0] == "#"]
    assert lines[0] == "*"
    assert {"!pyproject.toml", "!ps_proto/", "!ps_server/", "!ps_worker/"} <= set(lines)
    assert not any(line in ("!.env", "!.venv", "!.git") for line in lines)


USER_DOCKERFILE = REPO / "deploy" / "docker" / "examples" / "user.Dockerfile"


def test_bring_your_own_image_example_is_hadolint_clean_and_runs_the_script() -> None:
    hadolint = require_tool("hadolint")
    done = run_tool([hadolint, "--no-color", str(USER_DOCKERFILE)], timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    text = USER_DOCKERFILE.read_text()
    assert "ARG WORKER_IMAGE=grpc-ps-worker:0.1.0\nFROM ${WORKER_IMAGE}\n" in text
    image = parse_dockerfile(USER_DOCKERFILE)
    assert image.entrypoint == [] and image.cmd == [], "the worker image's entry point must stay in force"
    assert image.env["PS_SCRIPT"] == "/opt/grpc-ps-user/train.py"
    assert "COPY --chown=10001:10001 train.py ./" in text and "WORKDIR /opt/grpc-ps-user" in text
