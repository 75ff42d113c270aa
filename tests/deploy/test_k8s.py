"""deploy/k8s: renders, validates strictly against Kubernetes 1.30, and keeps its promises."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import kustomize_lite
import pytest
import yaml
from deploy_tools import require_tool
from deployment import POD_INDEX_LABEL, REPO, run_tool

K8S = REPO / "deploy" / "k8s"


def by_kind(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [r for r in resources if r["kind"] == kind and r["metadata"]["name"].startswith(name)]
    return found


def container(sts: dict[str, Any]) -> dict[str, Any]:
    (only,) = sts["spec"]["template"]["spec"]["containers"]
    return only


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def config_data(resources: list[dict[str, Any]]) -> dict[str, str]:
    return by_kind(resources, "ConfigMap", "grpc-ps-config")["data"]


@pytest.mark.parametrize("version", ["1.30", None], ids=["k8s-1.30", "k8s-newest"])
def test_kubernetes_validate_strict(rendered_k8s_yaml: str, version: str | None) -> None:
    validate = require_tool("kubernetes-validate")
    argv = [validate, "--strict", "--quiet", *(["-k", version] if version else []), "-"]
    done = run_tool(argv, timeout=120, input=rendered_k8s_yaml)
    assert done.returncode == 0, done.stdout + done.stderr


def test_rendered_resources(rendered_k8s: list[dict[str, Any]]) -> None:
    names = [(r["kind"], r["metadata"]["name"]) for r in rendered_k8s]
    # The generated ConfigMap's name ends in a content hash.
    kinds = sorted((kind, name.rsplit("-", 1)[0] if kind == "ConfigMap" else name) for kind, name in names)
    assert kinds == [
        ("ConfigMap", "grpc-ps-config"),
        ("Namespace", "grpc-ps"),
        ("NetworkPolicy", "ps"),
        ("NetworkPolicy", "worker"),
        ("PodDisruptionBudget", "ps"),
        ("Secret", "grpc-ps-tokens"),
        ("Service", "ps"),
        ("Service", "worker"),
        ("StatefulSet", "ps"),
        ("StatefulSet", "worker"),
    ]
    assert all(r["metadata"].get("namespace") == "grpc-ps" for r in rendered_k8s if r["kind"] != "Namespace")


def test_python_renderer_matches_kubectl(kubectl: str | None, rendered_k8s: list[dict[str, Any]]) -> None:
    """The fallback used where kubectl is absent renders exactly what kubectl does."""
    if kubectl is None:
        pytest.skip("kubectl absent: the rendering under test is kustomize_lite's own")
    key = lambda r: (r["kind"], r["metadata"]["name"])  # noqa: E731
    assert sorted(kustomize_lite.build(K8S), key=key) == sorted(rendered_k8s, key=key)


def test_python_renderer_refuses_what_it_does_not_know(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\npatches: [{path: p.yaml}]\n")
    with pytest.raises(NotImplementedError, match="patches"):
        kustomize_lite.build(tmp_path)


def test_headless_service_and_shard_statefulset(rendered_k8s: list[dict[str, Any]]) -> None:
    service = by_kind(rendered_k8s, "Service", "ps")
    sts = by_kind(rendered_k8s, "StatefulSet", "ps")
    spec = sts["spec"]
    c = container(sts)
    env = env_of(c)
    assert service["spec"]["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 50051, "data": 50052, "metrics": 8000}
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert spec["serviceName"] == "ps" and spec["podManagementPolicy"] == "Parallel"
    assert spec["replicas"] == int(config_data(rendered_k8s)["PS_NUM_SHARDS"]) == 2
    assert env["PS_SHARD_INDEX"] == {"fieldRef": {"fieldPath": POD_INDEX_LABEL}}
    assert env["PS_HOST"] == "0.0.0.0" and env["PS_PORT"] == "50051"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 50051, "data": 50052, "metrics": 8000} and env["PS_METRICS_PORT"] == "8000"
    assert env["PS_DATA_PORT"] == "50052"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": 50051}, probe
    (claim,) = spec["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == env["PS_CHECKPOINT_DIR"]
    assert {"configMapRef", "secretRef"} == {next(iter(s)) for s in c["envFrom"]}
    assert c["resources"]["requests"] and c["resources"]["limits"]


def test_worker_statefulset(rendered_k8s: list[dict[str, Any]]) -> None:
    sts = by_kind(rendered_k8s, "StatefulSet", "worker")
    shards = by_kind(rendered_k8s, "StatefulSet", "ps")["spec"]["replicas"]
    c = container(sts)
    env = env_of(c)
    assert sts["spec"]["replicas"] == int(config_data(rendered_k8s)["PS_NUM_WORKERS"]) == 2
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert env["PS_RANK"] == {"fieldRef": {"fieldPath": POD_INDEX_LABEL}}
    assert env["PS_SERVERS"] == ",".join(f"ps-{k}.ps:50051" for k in range(shards))
    assert env["PS_TOKEN"] == {"secretKeyRef": {"name": "grpc-ps-tokens", "key": "PS_TOKEN"}}
    # Least privilege: the worker never sees the admin token.
    assert "PS_ADMIN_TOKEN" not in env and not any("secretRef" in s for s in c["envFrom"])
    assert c["image"].startswith("grpc-ps-worker-gpu:")


@pytest.mark.parametrize("name", ["ps", "worker"])
def test_pods_are_locked_down(rendered_k8s: list[dict[str, Any]], name: str) -> None:
    template = by_kind(rendered_k8s, "StatefulSet", name)["spec"]["template"]
    pod = template["spec"]
    c = container(by_kind(rendered_k8s, "StatefulSet", name))
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False, "service links would inject PS_*_PORT variables"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    tmp = {m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/tmp"}
    assert tmp and all("emptyDir" in v for v in pod["volumes"] if v["name"] in tmp)
    assert template["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
    }


def test_config_and_secret(rendered_k8s: list[dict[str, Any]]) -> None:
    data = config_data(rendered_k8s)
    assert {"PS_MODE", "PS_NUM_WORKERS", "PS_NUM_SHARDS", "PS_STEPS", "PS_LR"} <= set(data)
    secret = by_kind(rendered_k8s, "Secret", "grpc-ps-tokens")
    assert secret["metadata"]["name"] == "grpc-ps-tokens"
    tokens = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(tokens) == {"PS_TOKEN", "PS_ADMIN_TOKEN"}
    assert all(v.startswith("EXAMPLE-") for v in tokens.values()), "example tokens must say so"


def test_pdb_and_network_policies_select_the_pods(rendered_k8s: list[dict[str, Any]]) -> None:
    ps_labels = by_kind(rendered_k8s, "StatefulSet", "ps")["spec"]["template"]["metadata"]["labels"]
    worker_labels = by_kind(rendered_k8s, "StatefulSet", "worker")["spec"]["template"]["metadata"]["labels"]
    pdb = by_kind(rendered_k8s, "PodDisruptionBudget", "ps")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= ps_labels.items()
    policy = by_kind(rendered_k8s, "NetworkPolicy", "ps")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= ps_labels.items()
    grpc_rule = next(r for r in policy["ingress"] if {"port": 50051, "protocol": "TCP"} in r["ports"])
    assert {"port": 50052, "protocol": "TCP"} in grpc_rule["ports"]  # the data connections: workers only
    (source,) = grpc_rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= worker_labels.items()


def test_service_monitor_is_an_example_outside_the_kustomization(rendered_k8s: list[dict[str, Any]]) -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "servicemonitor.yaml" not in kustomization["resources"]
    monitor = yaml.safe_load((K8S / "servicemonitor.yaml").read_text())
    assert monitor["kind"] == "ServiceMonitor" and monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [r for r in rendered_k8s if r["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services if selector.items() <= s["metadata"]["labels"].items()} == {
        "ps",
        "worker",
    }
    for service in services:
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    json.dumps(monitor)  # plain data, no YAML-only types


FAKE_WORKERS = {
    "trains": '#!/bin/sh\necho \'{"event": "done"}\'\n',
    "fails": "#!/bin/sh\nexit 3\n",
    "runs": "#!/bin/sh\necho started\nexec sleep 300\n",
}


def start_worker_wrapper(rendered_k8s: list[dict[str, Any]], tmp_path: Path, fake: str) -> subprocess.Popen[str]:
    """The worker container's command, with a stand-in ps-worker first on PATH."""
    bin_dir = tmp_path / fake
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ps-worker").write_text(FAKE_WORKERS[fake])
    (bin_dir / "ps-worker").chmod(0o755)
    command = container(by_kind(rendered_k8s, "StatefulSet", "worker"))["command"]
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin"}
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def group_gone(popen: subprocess.Popen[str]) -> bool:
    try:
        os.killpg(popen.pid, 0)
    except ProcessLookupError:
        return True
    os.killpg(popen.pid, signal.SIGKILL)
    return False


def test_worker_wrapper_idles_after_training_and_exits_0_on_sigterm(
    rendered_k8s: list[dict[str, Any]], tmp_path: Path
) -> None:
    """Repeated, because a signal landing just as the idle step starts is the case that can hang."""
    for _ in range(15):
        wrapper = start_worker_wrapper(rendered_k8s, tmp_path, "trains")
        assert wrapper.stdout is not None and wrapper.stderr is not None
        assert '"event": "done"' in wrapper.stdout.readline()
        assert "training finished; idling" in wrapper.stderr.readline()
        assert wrapper.poll() is None
        os.kill(wrapper.pid, signal.SIGTERM)
        try:
            assert wrapper.wait(timeout=10) == 0
        finally:
            assert group_gone(wrapper)
            wrapper.communicate(timeout=10)


def test_worker_wrapper_passes_failures_and_sigterm_through(rendered_k8s: list[dict[str, Any]], tmp_path: Path) -> None:
    failing = start_worker_wrapper(rendered_k8s, tmp_path, "fails")
    assert failing.wait(timeout=10) == 3, "a failed worker must exit non-zero so that it is restarted"
    failing.communicate(timeout=10)
    running = start_worker_wrapper(rendered_k8s, tmp_path, "runs")
    assert running.stdout is not None and running.stdout.readline().strip() == "started"
    os.kill(running.pid, signal.SIGTERM)
    try:
        assert running.wait(timeout=10) == 128 + signal.SIGTERM, "SIGTERM must reach ps-worker while it trains"
    finally:
        assert group_gone(running)
        running.communicate(timeout=10)


# ---------------------------------------------------------------------------------------- user-script overlay
OVERLAY = REPO / "deploy" / "k8s-overlays" / "user-script"


@pytest.mark.parametrize("version", ["1.30", None], ids=["k8s-1.30", "k8s-newest"])
def test_user_script_overlay_validates_strict(rendered_user_script_yaml: str, version: str | None) -> None:
    validate = require_tool("kubernetes-validate")
    argv = [validate, "--strict", "--quiet", *(["-k", version] if version else []), "-"]
    done = run_tool(argv, timeout=120, input=rendered_user_script_yaml)
    assert done.returncode == 0, done.stdout + done.stderr


def test_user_script_overlay_changes_only_the_workers_program(
    rendered_k8s: list[dict[str, Any]], rendered_user_script: list[dict[str, Any]]
) -> None:
    (config_map,) = [r for r in rendered_user_script if r["metadata"]["name"].startswith("grpc-ps-user-script-")]
    assert config_map["metadata"]["namespace"] == "grpc-ps"
    assert config_map["data"] == {"train.py": (OVERLAY / "train.py").read_text()}
    assert (OVERLAY / "train.py").read_text() == (REPO / "examples" / "cnn_digits.py").read_text()
    sts = by_kind(rendered_user_script, "StatefulSet", "worker")
    c, pod = container(sts), sts["spec"]["template"]["spec"]
    assert env_of(c)["PS_SCRIPT"] == "/opt/grpc-ps-user/train.py"
    assert {"name": "user-script", "mountPath": "/opt/grpc-ps-user", "readOnly": True} in c["volumeMounts"]
    assert {"name": "user-script", "configMap": {"name": config_map["metadata"]["name"]}} in pod["volumes"]
    # Everything else as deploy/k8s renders it: the same shards, services, secret, rank and token wiring.
    base_worker = by_kind(rendered_k8s, "StatefulSet", "worker")
    base_c = container(base_worker)
    assert {k: v for k, v in env_of(c).items() if k != "PS_SCRIPT"} == env_of(base_c)
    assert c["command"] == base_c["command"] and c["image"] == base_c["image"]
    assert c["securityContext"] == base_c["securityContext"]
    others = lambda rs: sorted(  # noqa: E731
        (json.dumps(r, sort_keys=True) for r in rs if r["kind"] != "StatefulSet" or r["metadata"]["name"] != "worker"),
    )
    assert others(r for r in rendered_user_script if r is not config_map) == others(rendered_k8s)
