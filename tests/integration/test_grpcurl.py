"""The Admin and ParameterService APIs by name, with the real grpcurl and buf curl over reflection.

grpcurl prints JSON with the proto field names (num_shards); buf curl with lowerCamelCase (numShards).
"""

from __future__ import annotations

import json
import subprocess

import pytest

SERVICES = {
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "ps.v1.Admin",
    "ps.v1.ParameterService",
}


def run(argv: list[str], tmp_path, expect_ok: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=tmp_path)
    if expect_ok:
        assert result.returncode == 0, f"{argv} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture
def shard(start_cluster):
    (s,) = start_cluster(1, num_workers=2)
    return s


def test_grpcurl_list_describe_status_join_and_health(shard, tool, tmp_path) -> None:
    grpcurl = [tool("grpcurl"), "-plaintext", "-max-time", "10"]
    addr = shard.address

    listed = run([*grpcurl, addr, "list"], tmp_path).stdout.split()
    assert set(listed) == SERVICES

    described = run([*grpcurl, addr, "describe", "ps.v1.Admin"], tmp_path).stdout
    assert "service Admin" in described and "rpc GetStatus" in described

    joined = json.loads(
        run(
            [*grpcurl, "-d", '{"rank": 1, "numWorkers": 2, "incarnation": 7}', addr, "ps.v1.ParameterService/Join"],
            tmp_path,
        ).stdout
    )
    assert joined["num_shards"] == 1 and joined["config"]["mode"] == "MODE_SYNC"

    bad = run(
        [*grpcurl, "-format-error", "-d", '{"rank": 0, "numWorkers": 5}', addr, "ps.v1.ParameterService/Join"],
        tmp_path,
        expect_ok=False,
    )
    assert bad.returncode != 0
    error = json.loads(bad.stderr)
    assert error["code"] == 3  # INVALID_ARGUMENT
    assert "num_workers=2" in error["message"]

    status = json.loads(run([*grpcurl, "-emit-defaults", "-d", "{}", addr, "ps.v1.Admin/GetStatus"], tmp_path).stdout)
    st = status["status"]
    assert st["shard_index"] == 0 and st["num_shards"] == 1 and st["initialized"] is False
    config = st["config"]
    assert (config["mode"], config["num_workers"], config["lease_timeout_seconds"]) == ("MODE_SYNC", 2, 10)
    assert config["max_staleness"] == "-1" and config["communication_period"] == 10  # int64 is a JSON string
    states = {w["rank"]: w["state"] for w in st["workers"]}
    assert states == {0: "WORKER_STATE_PENDING", 1: "WORKER_STATE_LIVE"}
    assert int(st["received_bytes"]) == 0  # Join is not data-plane traffic

    health = json.loads(run([*grpcurl, addr, "grpc.health.v1.Health/Check"], tmp_path).stdout)
    assert health == {"status": "SERVING"}
    health = json.loads(
        run(
            [*grpcurl, "-d", '{"service": "ps.v1.ParameterService"}', addr, "grpc.health.v1.Health/Check"], tmp_path
        ).stdout
    )
    assert health == {"status": "SERVING"}


def test_grpcurl_with_tokens(start_cluster, tool, tmp_path) -> None:
    (s,) = start_cluster(1, num_workers=1, token="worker-secret", admin_token="admin-secret")
    grpcurl = [tool("grpcurl"), "-plaintext", "-max-time", "10"]
    assert set(run([*grpcurl, s.address, "list"], tmp_path).stdout.split()) == SERVICES  # reflection stays open
    refused = run([*grpcurl, "-d", "{}", s.address, "ps.v1.Admin/GetStatus"], tmp_path, expect_ok=False)
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr
    auth = ["-H", "authorization: Bearer admin-secret"]
    status = json.loads(run([*grpcurl, *auth, "-d", "{}", s.address, "ps.v1.Admin/GetStatus"], tmp_path).stdout)
    assert status["status"]["num_shards"] == 1


def test_buf_curl_list_and_status(shard, tool, tmp_path) -> None:
    buf = [tool("buf"), "curl", "--protocol", "grpc", "--http2-prior-knowledge", "--reflect", "--timeout", "10s"]
    base = f"http://{shard.address}"
    assert set(run([*buf, "--list-services", base], tmp_path).stdout.split()) == SERVICES
    methods = run([*buf, "--list-methods", base], tmp_path).stdout.split()
    assert "ps.v1.Admin/GetStatus" in methods and "ps.v1.ParameterService/Push" in methods
    status = json.loads(run([*buf, "--emit-defaults", "-d", "{}", f"{base}/ps.v1.Admin/GetStatus"], tmp_path).stdout)
    assert status["status"]["numShards"] == 1 and status["status"]["config"]["mode"] == "MODE_SYNC"
    bad = run([*buf, "-d", '{"numWorkers": 9}', f"{base}/ps.v1.ParameterService/Join"], tmp_path, expect_ok=False)
    assert bad.returncode != 0 and json.loads(bad.stdout or bad.stderr)["code"] == "invalid_argument"
