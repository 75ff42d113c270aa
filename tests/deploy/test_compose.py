"""docker-compose.yml: accepted by docker-compose, valid against the Compose Specification schema,
and consistent (shards, ranks, profiles, GPU reservations)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from deployment import REPO, compose_config, read_env_file, run_tool

SCHEMA = Path(__file__).parent / "schemas" / "compose-spec.json"


@pytest.fixture(scope="module")
def compose_file() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_docker_compose_config_accepts_it(docker_compose: str) -> None:
    done = run_tool(
        [docker_compose, "-f", "docker-compose.yml", "--env-file", ".env.example", "config", "-q"], timeout=60, cwd=REPO
    )
    assert done.returncode == 0, done.stderr


def test_tokens_are_required(docker_compose: str, tmp_path: Path) -> None:
    """Without PS_TOKEN (no .env), compose refuses and says what to do."""
    empty = tmp_path / "empty.env"
    empty.write_text("")
    done = run_tool(
        [docker_compose, "-f", str(REPO / "docker-compose.yml"), "--env-file", str(empty), "config", "-q"],
        timeout=60,
        cwd=tmp_path,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin"},
    )
    assert done.returncode != 0
    assert "cp .env.example .env" in done.stderr


def test_valid_against_the_compose_spec_schema(compose_file: dict[str, Any]) -> None:
    validator = jsonschema.Draft201909Validator(json.loads(SCHEMA.read_text()))
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(compose_file)]
    assert not errors, "\n".join(errors)


def test_the_schema_rejects_an_unknown_key(compose_file: dict[str, Any]) -> None:
    """The check has teeth: a misspelt key fails it."""
    broken = copy.deepcopy(compose_file)
    broken["services"]["ps-0"]["helthcheck"] = broken["services"]["ps-0"].pop("healthcheck")
    validator = jsonschema.Draft201909Validator(json.loads(SCHEMA.read_text()))
    assert list(validator.iter_errors(broken))


def test_shards_workers_and_profiles_agree(compose_model: dict[str, Any]) -> None:
    services = compose_model["services"]
    shards = {n: s for n, s in services.items() if s["image"].startswith("grpc-ps-server")}
    assert sorted(shards) == ["ps-0", "ps-1"]
    for name, shard in shards.items():
        env = shard["environment"]
        assert env["PS_SHARD_INDEX"] == name.removeprefix("ps-")
        assert env["PS_NUM_SHARDS"] == str(len(shards))
        assert env["PS_HOST"] == "0.0.0.0" and env["PS_PORT"] == "50051" and env["PS_DATA_PORT"] == "50052"
        assert shard["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "ps_server.healthcheck"]
        (volume,) = shard["volumes"]
        assert volume.split(":")[1] == env["PS_CHECKPOINT_DIR"] and volume.split(":")[0] in compose_model["volumes"]
    default_profiles = set(read_env_file(REPO / ".env.example")["COMPOSE_PROFILES"].split(","))
    assert default_profiles == {"cpu"}
    for profile, image in (("cpu", "grpc-ps-worker:"), ("gpu", "grpc-ps-worker-gpu:")):
        workers = {n: s for n, s in services.items() if s.get("profiles") == [profile]}
        assert all(s["image"].startswith(image) for s in workers.values())
        assert sorted(int(s["environment"]["PS_RANK"]) for s in workers.values()) == [0, 1]
        for worker in workers.values():
            env = worker["environment"]
            assert env["PS_NUM_WORKERS"] == str(len(workers))
            assert env["PS_SERVERS"] == ",".join(f"{n}:50051" for n in sorted(shards))
            assert worker["restart"] == "no"
            assert {d: c["condition"] for d, c in worker["depends_on"].items()} == dict.fromkeys(
                shards, "service_healthy"
            )


def test_gpu_workers_differ_from_cpu_workers_only_in_image_and_devices(compose_model: dict[str, Any]) -> None:
    services = compose_model["services"]
    for rank in (0, 1):
        cpu, gpu = services[f"worker-{rank}"], services[f"worker-gpu-{rank}"]
        assert cpu["environment"] == gpu["environment"]
        (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
        same = {k for k in cpu if k not in ("image", "build", "profiles", "deploy")}
        assert {k: cpu[k] for k in same} == {k: gpu[k] for k in same}


def test_prometheus_mounts_its_compose_config(compose_model: dict[str, Any]) -> None:
    prometheus = compose_model["services"]["prometheus"]
    assert prometheus["image"].startswith("prom/prometheus:v")
    mounts = [v.split(":") for v in prometheus["volumes"]]
    assert [str(REPO / "deploy/prometheus/prometheus-compose.yml"), "/etc/prometheus/prometheus.yml", "ro"] in mounts


def test_user_script_override_mounts_the_script_and_needs_it_named(docker_compose: str) -> None:
    override = ["-f", "docker-compose.yml", "-f", "deploy/compose/user-script.yml", "--env-file", ".env.example"]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
    missing = run_tool([docker_compose, *override, "config", "-q"], timeout=60, cwd=REPO, env=env)
    assert missing.returncode != 0 and "set PS_USER_SCRIPT to your training script" in missing.stderr
    done = run_tool(
        [docker_compose, *override, "config"],
        timeout=60,
        cwd=REPO,
        env={**env, "PS_USER_SCRIPT": "./examples/cnn_digits.py"},
    )
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    for name in ("worker-0", "worker-1"):
        assert services[name]["environment"]["PS_SCRIPT"] == "/opt/grpc-ps-user/train.py"
        assert services[name]["volumes"] == [f"{REPO / 'examples/cnn_digits.py'}:/opt/grpc-ps-user/train.py:ro"]
        assert services[name]["read_only"] is True, "the override keeps the workers locked down"
    assert "volumes" not in services["worker-gpu-0"] and "PS_SCRIPT" not in services["ps-0"]["environment"]


def test_three_shards_override_adds_ps_2_like_the_others(docker_compose: str, compose_model: dict[str, Any]) -> None:
    """deploy/compose/three-shards.yml: 3 shards told PS_NUM_SHARDS=3, ps-2 the same service as ps-1
    but for its index, volume and host port (docker-compose v1 merges both files the same way: it
    drops pull_policy from every service), every worker lists and waits for the three."""
    three = compose_config(docker_compose, REPO / ".env.example", (REPO / "deploy" / "compose" / "three-shards.yml",))
    services, before = three["services"], compose_model["services"]
    shards = ("ps-0", "ps-1", "ps-2")
    assert {"ps-0-checkpoints", "ps-1-checkpoints", "ps-2-checkpoints"} <= set(three["volumes"])
    for k, name in enumerate(shards):
        env = services[name]["environment"]
        assert (env["PS_NUM_SHARDS"], env["PS_SHARD_INDEX"]) == ("3", str(k))
        assert services[name]["volumes"] == [f"ps-{k}-checkpoints:{env['PS_CHECKPOINT_DIR']}:rw"]
    differ = ("environment", "volumes", "ports")
    assert {k: v for k, v in services["ps-2"].items() if k not in differ} == {
        k: v for k, v in services["ps-1"].items() if k not in differ
    }
    env_1 = {**before["ps-1"]["environment"], "PS_NUM_SHARDS": "3", "PS_SHARD_INDEX": "2"}
    assert services["ps-2"]["environment"] == env_1
    for name in ("worker-0", "worker-1", "worker-gpu-0", "worker-gpu-1"):
        worker = services[name]
        assert worker["environment"] == {
            **before[name]["environment"],
            "PS_SERVERS": ",".join(f"{s}:50051" for s in shards),
        }
        assert {d: c["condition"] for d, c in worker["depends_on"].items()} == dict.fromkeys(shards, "service_healthy")
