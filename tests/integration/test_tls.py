"""TLS and mutual TLS with a CA made by the test (openssl), for workers and ``ps-admin``; plaintext to a TLS
shard fails cleanly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from ps_common.channels import channel
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_worker import DistributedOptimizer, PSClient
from tests.conftest import RPC_TIMEOUT, small_model


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a shard certificate for 127.0.0.1/localhost, and a worker client certificate."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test CA")
    d = tmp_path_factory.mktemp("pki")
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=grpc-ps test CA",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("shard", "worker"):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            "-extfile",
            "san.ext",
            cwd=d,
        )
    return d


def train_two_steps(address: str, **tls: str) -> int:
    model = small_model()
    with PSClient([address], rank=0, num_workers=1, timeout=RPC_TIMEOUT, retry_deadline=2.0, **tls) as c:
        c.init(model, {"name": "sgd", "lr": 0.1})
        opt = DistributedOptimizer(model, c)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        return c.version


def test_tls_shard_trains_and_refuses_plaintext(start_cluster, pki: Path) -> None:
    (shard,) = start_cluster(
        num_shards=1, num_workers=1, tls_cert=str(pki / "shard.pem"), tls_key=str(pki / "shard.key")
    )
    assert train_two_steps(shard.address, tls_ca=str(pki / "ca.pem")) == 2
    with grpc.insecure_channel(shard.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ps_pb2_grpc.AdminStub(ch).GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def mutual_tls_shard(start_cluster, pki: Path):
    """One shard that serves TLS with the test CA's certificate and asks clients for theirs."""
    (shard,) = start_cluster(
        num_shards=1,
        num_workers=1,
        tls_cert=str(pki / "shard.pem"),
        tls_key=str(pki / "shard.key"),
        tls_client_ca=str(pki / "ca.pem"),
    )
    return shard


def test_mutual_tls_requires_a_client_certificate(start_cluster, pki: Path) -> None:
    shard = mutual_tls_shard(start_cluster, pki)
    with channel(shard.address, tls_ca=str(pki / "ca.pem")) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ps_pb2_grpc.AdminStub(ch).GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    version = train_two_steps(
        shard.address, tls_ca=str(pki / "ca.pem"), tls_cert=str(pki / "worker.pem"), tls_key=str(pki / "worker.key")
    )
    assert version == 2


def test_tls_settings_are_validated(pki: Path) -> None:
    from ps_common.errors import InvalidRequestError
    from ps_server.config import ServerConfig

    with pytest.raises(InvalidRequestError, match="go together"):
        ServerConfig(0, 1, 1, tls_cert=str(pki / "shard.pem"))
    with pytest.raises(InvalidRequestError, match="not a readable file"):
        ServerConfig(0, 1, 1, tls_cert=str(pki / "nope.pem"), tls_key=str(pki / "shard.key"))
    with pytest.raises(ValueError, match="needs tls_ca"):
        channel("127.0.0.1:1", tls_cert=str(pki / "worker.pem"), tls_key=str(pki / "worker.key"))


def ps_admin(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PS_")} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "ps_admin.cli", *args], capture_output=True, text=True, timeout=60, env=environ
    )


def test_ps_admin_over_tls(start_cluster, pki: Path) -> None:
    (shard,) = start_cluster(
        num_shards=1, num_workers=1, tls_cert=str(pki / "shard.pem"), tls_key=str(pki / "shard.key")
    )
    ok = ps_admin("--servers", shard.address, "--tls-ca", str(pki / "ca.pem"), "status")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("grpc-ps: 1/1 shards, mode sync, version 0")
    plain = ps_admin("--servers", shard.address, "--timeout", "3", "status")
    assert plain.returncode == 1
    assert plain.stderr.startswith(f"ps-admin: {shard.address}: UNAVAILABLE: ")
    assert plain.stderr.rstrip().endswith(
        "(is the shard running? check --servers, and --tls-ca if the shards serve TLS)"
    )


def test_ps_admin_over_mutual_tls_from_the_environment(start_cluster, pki: Path) -> None:
    shard = mutual_tls_shard(start_cluster, pki)
    ca_only = ps_admin("--servers", shard.address, "--timeout", "3", "--tls-ca", str(pki / "ca.pem"), "status")
    assert ca_only.returncode == 1 and f"ps-admin: {shard.address}: UNAVAILABLE: " in ca_only.stderr
    env = {
        "PS_TLS_CA": str(pki / "ca.pem"),
        "PS_TLS_CERT": str(pki / "worker.pem"),
        "PS_TLS_KEY": str(pki / "worker.key"),
    }
    status = ps_admin("--servers", shard.address, "status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["ok"] is True
    top = ps_admin("--servers", shard.address, "top", "--iterations", "1", env=env)  # WatchStatus streams too
    assert top.returncode == 0, top.stderr
    assert "grpc-ps: 1/1 shards" in top.stdout


def test_ps_admin_refuses_inconsistent_tls_flags(pki: Path) -> None:
    half = ps_admin(
        "--servers", "127.0.0.1:1", "--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "worker.pem"), "status"
    )
    assert half.returncode == 2 and "--tls-cert, --tls-key) go together" in half.stderr
    no_ca = ps_admin(
        "--servers",
        "127.0.0.1:1",
        "--tls-cert",
        str(pki / "worker.pem"),
        "--tls-key",
        str(pki / "worker.key"),
        "status",
    )
    assert no_ca.returncode == 2 and "needs tls_ca (--tls-ca)" in no_ca.stderr
    missing = ps_admin("--servers", "127.0.0.1:1", "--tls-ca", str(pki / "nope.pem"), "status")
    assert missing.returncode == 2
    assert f"Cannot read the TLS file '{pki / 'nope.pem'}': No such file or directory." in missing.stderr


def test_non_loopback_bind_without_tokens_refuses_to_start() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PS_")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ps_server.cli",
            "--shard-index",
            "0",
            "--num-shards",
            "1",
            "--num-workers",
            "1",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2
    assert "Refusing to serve on non-loopback address '0.0.0.0' without both PS_TOKEN and PS_ADMIN_TOKEN" in out.stderr
