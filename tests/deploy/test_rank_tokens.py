"""Per-rank tokens in the deployment files (issue 43): deploy/compose/rank-tokens.yml and the overlay
deploy/k8s-overlays/rank-tokens give every shard all the ranks' tokens and each worker only its own.
The k8s init container's selection runs here as written, on the example Secret."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from deploy_tools import require_tool
from deployment import REPO, compose_config, compose_processes, read_env_file, run_tool
from test_checkov import run_checkov
from test_parity import DEADLINE_SECONDS, run_cluster

from ps_common.errors import reason_of
from ps_launch.tokens import write_deployment_files
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_server.service.rank_tokens import load_rank_tokens, parse_rank_tokens

OVERLAY = REPO / "deploy" / "k8s-overlays" / "rank-tokens"
OVERRIDE = REPO / "deploy" / "compose" / "rank-tokens.yml"
ALL_TOKENS = "/var/run/grpc-ps/rank-tokens"
OWN_TOKEN = "/var/run/grpc-ps/token"


@pytest.fixture(scope="module")
def rendered_yaml() -> str:
    done = run_tool([require_tool("kubectl"), "kustomize", str(OVERLAY)], timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def rendered(rendered_yaml: str) -> dict[tuple[str, str], Any]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(rendered_yaml) if d}


def mounts(container: dict[str, Any]) -> dict[str, str]:
    """mount path -> volume name."""
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def test_k8s_shards_read_every_rank_s_token(rendered: dict[tuple[str, str], Any]) -> None:
    secret = rendered[("Secret", "grpc-ps-rank-tokens")]
    pod = rendered[("StatefulSet", "ps")]["spec"]["template"]["spec"]
    (shard,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in shard["env"]}
    assert env["PS_RANK_TOKENS_FILE"] == f"{ALL_TOKENS}/rank-tokens"
    volume = mounts(shard)[ALL_TOKENS]
    (source,) = [v for v in pod["volumes"] if v["name"] == volume]
    assert source["secret"]["secretName"] == secret["metadata"]["name"] and "rank-tokens" in secret["data"]
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]  # 0440 files readable


def test_k8s_a_worker_s_training_container_holds_only_its_own_token(rendered: dict[tuple[str, str], Any]) -> None:
    pod = rendered[("StatefulSet", "worker")]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (worker,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    secret_volumes = {n for n, v in volumes.items() if "secret" in v}
    # the training container mounts no Secret at all, and has no token in its environment
    assert not set(mounts(worker).values()) & secret_volumes
    env = {e["name"]: e for e in worker["env"]}
    assert "PS_TOKEN" not in env and "PS_ADMIN_TOKEN" not in env
    assert not [s for s in worker.get("envFrom", []) if "secretRef" in s]
    assert env["PS_TOKEN_FILE"]["value"] == f"{OWN_TOKEN}/token"
    own = mounts(worker)[OWN_TOKEN]
    assert volumes[own]["emptyDir"]["medium"] == "Memory"
    assert next(m for m in worker["volumeMounts"] if m["mountPath"] == OWN_TOKEN)["readOnly"] is True
    # only the init container sees every rank's token; it writes the pod's own to that emptyDir
    assert mounts(init) == {ALL_TOKENS: "rank-tokens", OWN_TOKEN: own}
    assert volumes["rank-tokens"]["secret"]["secretName"] == "grpc-ps-rank-tokens"
    assert init["image"] == worker["image"] and init["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]


@pytest.mark.parametrize("rank", [0, 1])
def test_k8s_the_init_container_writes_its_rank_s_line_only(
    rendered: dict[tuple[str, str], Any], tmp_path: Path, rank: int
) -> None:
    """The init container's command as written, on the example Secret, with its two mounts moved here."""
    (init,) = rendered[("StatefulSet", "worker")]["spec"]["template"]["spec"]["initContainers"]
    example = (OVERLAY / "rank-tokens.example").read_text()
    (tmp_path / "all").mkdir()
    (tmp_path / "all" / "rank-tokens").write_text(example)
    (tmp_path / "own").mkdir()
    script = init["command"][2].replace(ALL_TOKENS, str(tmp_path / "all")).replace(OWN_TOKEN, str(tmp_path / "own"))
    env = {"PATH": "/usr/bin:/bin", "PS_RANK": str(rank)}
    done = subprocess.run([*init["command"][:2], script], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    written = tmp_path / "own" / "token"
    assert written.read_text().strip() == parse_rank_tokens(example).token_of(rank)
    assert stat.S_IMODE(written.stat().st_mode) == 0o600 and os.listdir(tmp_path / "own") == ["token"]
    missing = subprocess.run(
        [*init["command"][:2], script], env={**env, "PS_RANK": "7"}, capture_output=True, text=True, timeout=30
    )
    assert missing.returncode == 1 and "no token for rank 7" in missing.stderr  # the pod does not start


def test_k8s_overlay_validates_strictly_and_passes_checkov(rendered_yaml: str, tmp_path: Path) -> None:
    validate = require_tool("kubernetes-validate")
    done = run_tool([validate, "--strict", "--quiet", "-k", "1.30", "-"], timeout=120, input=rendered_yaml)
    assert done.returncode == 0, done.stdout + done.stderr
    rendered = tmp_path / "rank-tokens.yaml"
    rendered.write_text(rendered_yaml)
    summaries = run_checkov([rendered, REPO / "deploy" / "docker" / "worker-gpu.Dockerfile"], tmp_path)
    assert summaries["kubernetes"]["resource_count"] >= 9 and summaries["dockerfile"]["resource_count"] == 1


def test_compose_mounts_every_token_into_the_shards_and_its_own_into_each_worker(docker_compose: str) -> None:
    model = compose_config(docker_compose, REPO / ".env.example", (OVERRIDE,))
    files = {name: Path(s["file"]) for name, s in model["secrets"].items()}
    assert files == {
        "rank-tokens": REPO / "secrets" / "rank-tokens",
        "rank-0-token": REPO / "secrets" / "rank-0.token",
        "rank-1-token": REPO / "secrets" / "rank-1.token",
    }
    services = model["services"]
    for shard in ("ps-0", "ps-1"):
        assert [s["source"] for s in services[shard]["secrets"]] == ["rank-tokens"]
        assert services[shard]["environment"]["PS_RANK_TOKENS_FILE"] == "/run/secrets/rank-tokens"
    for name in ("worker-0", "worker-1", "worker-gpu-0", "worker-gpu-1"):
        worker, rank = services[name], name[-1]
        assert [s["source"] for s in worker["secrets"]] == [f"rank-{rank}-token"]
        env = worker["environment"]
        assert env["PS_TOKEN"] == "" and env["PS_TOKEN_FILE"] == f"/run/secrets/rank-{rank}-token"
        assert "PS_ADMIN_TOKEN" not in env and "PS_RANK_TOKENS_FILE" not in env
    assert "secrets" not in services["prometheus"]


def test_compose_secrets_come_from_the_files_ps_launch_tokens_writes(docker_compose: str, tmp_path: Path) -> None:
    """``python -m ps_launch.tokens 2 DIR`` writes what the override names under PS_SECRETS_DIR."""
    done = subprocess.run(
        ["python", "-m", "ps_launch.tokens", "2", str(tmp_path / "s")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    env = {"PATH": os.environ["PATH"], "PS_SECRETS_DIR": str(tmp_path / "s")}
    model = compose_config(docker_compose, REPO / ".env.example", (OVERRIDE,), env=env)
    shards = load_rank_tokens(model["secrets"]["rank-tokens"]["file"])
    for rank in (0, 1):
        assert Path(model["secrets"][f"rank-{rank}-token"]["file"]).read_text().strip() == shards.token_of(rank)


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_SECONDS + 120)
def test_compose_with_rank_tokens_trains_and_refuses_a_worker_acting_as_another_rank(
    docker_compose: str, tmp_path: Path
) -> None:
    """docker-compose.yml with the override, its services run as local processes on 127.0.0.1 with their
    secrets' files where the containers mount them: the job trains, and rank 1's token file cannot join
    or push as rank 0 on any shard."""
    secrets_dir = tmp_path / "secrets"
    write_deployment_files(2, secrets_dir)
    env = {"PATH": os.environ["PATH"], "PS_SECRETS_DIR": str(secrets_dir)}
    model = compose_config(docker_compose, REPO / ".env.example", (OVERRIDE,), env=env)
    profiles = set(read_env_file(REPO / ".env.example").get("COMPOSE_PROFILES", "").split(","))
    processes = compose_processes(model, profiles)
    worker_1 = next(p for p in processes if p.name == "worker-1")
    token_1 = Path(worker_1.files[worker_1.env["PS_TOKEN_FILE"]]).read_text().strip()
    refused: dict[str, str] = {}

    def act_as_rank_0(addresses: dict[str, str]) -> None:
        as_one = (("authorization", f"Bearer {token_1}"),)
        join = ps_pb2.JoinRequest(rank=0, num_workers=2, incarnation=2**40)
        once = ps_pb2.PushPullOnceRequest(header=ps_pb2.PushHeader(rank=0, incarnation=1, clock=300))
        for shard in ("ps-0", "ps-1"):
            with grpc.insecure_channel(addresses[shard]) as channel:
                stub = ps_pb2_grpc.ParameterServiceStub(channel)
                for name, method, request in (("Join", stub.Join, join), ("PushPullOnce", stub.PushPullOnce, once)):
                    with pytest.raises(grpc.RpcError) as err:
                        method(request, timeout=30, metadata=as_one)
                    refused[f"{shard} {name}"] = f"{err.value.code().name} {reason_of(err.value)}"

    summaries = run_cluster(processes, tmp_path, workers_idle_after_training=False, after_training=act_as_rank_0)
    assert sorted(s["rank"] for s in summaries) == [0, 1]
    assert len(refused) == 4 and set(refused.values()) == {"PERMISSION_DENIED WRONG_RANK"}, refused
