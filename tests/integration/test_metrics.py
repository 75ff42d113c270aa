"""Prometheus metrics of a live shard and worker, scraped over HTTP and linted by promtool."""

from __future__ import annotations

import math
import subprocess
import urllib.request

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from ps_common.metrics_endpoint import serve_metrics
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_server.metrics import REFUSAL_REASONS
from ps_worker.client import PSClient
from ps_worker.metrics import WorkerMetrics
from ps_worker.workloads.registry import get_workload
from ps_worker.workloads.train import train

STEPS = 6
PUSH = "ps.v1.ParameterService/Push"
PULL = "ps.v1.ParameterService/Pull"
PUSH_PULL = "ps.v1.ParameterService/PushPullOnce"  # the digits model fits in one message
INIT = "ps.v1.ParameterService/Init"


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        assert reply.status == 200
        return reply.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value of every sample in an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(found: dict, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def promtool_check(promtool: str, text: str) -> None:
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_training_moves_shard_and_worker_metrics(start_cluster, tool) -> None:
    promtool = tool("promtool")
    (shard,) = start_cluster(1, num_workers=1)
    worker = WorkerMetrics(CollectorRegistry())
    endpoint = serve_metrics(worker.registry, "127.0.0.1", 0)
    client = PSClient([shard.address], rank=0, num_workers=1, timeout=10, metrics=worker)
    try:
        summary = train(
            get_workload("digits"),
            client,
            steps=STEPS,
            batch_size=16,
            optimizer={"name": "sgd", "lr": 0.1},
            metrics=worker,
        )
    finally:
        client.close()
    assert summary.version == STEPS
    try:
        shard_text, worker_text = scrape(shard.metrics_url), scrape(endpoint.url)
    finally:
        endpoint.close()

    s = samples(shard_text)
    assert value(s, "ps_model_version") == STEPS
    assert value(s, "ps_workers", state="left") == 1
    assert value(s, "ps_workers", state="live") == 0
    assert value(s, "ps_pushes_total", mode="sync") == STEPS
    assert value(s, "ps_push_staleness_count") == STEPS
    assert value(s, "ps_push_staleness_sum") == 0  # sync: never stale
    # a training step is one PushPullOnce (push, then the round's weights); Pull once, after Init
    assert value(s, "ps_rpc_duration_seconds_count", method=PUSH_PULL, code="OK") == STEPS
    assert value(s, "ps_rpc_duration_seconds_count", method=PULL, code="OK") == 1
    assert value(s, "ps_rpc_duration_seconds_count", method=PUSH, code="OK") == 0
    assert value(s, "ps_barrier_wait_seconds_count") == STEPS + 1
    assert value(s, "ps_received_bytes_total", method=PUSH_PULL) > 0
    assert value(s, "ps_sent_bytes_total", method=PULL) > 0
    assert value(s, "ps_last_checkpoint_version") == 0
    assert value(s, "ps_checkpoint_duration_seconds_count") == 0
    assert value(s, "ps_last_checkpoint_timestamp_seconds") == 0
    assert value(s, "ps_rejected_pushes_total", reason="invalid_argument") == 0
    for reason in REFUSAL_REASONS:  # the shard's own reasons, exported at 0 from the start
        assert s[("ps_rejected_pushes_total", frozenset({("reason", reason)}))] == 0

    w = samples(worker_text)
    assert value(w, "ps_worker_step_duration_seconds_count") == STEPS
    assert value(w, "ps_worker_push_pull_duration_seconds_count") == STEPS  # PushPull: push and the round's pull
    assert value(w, "ps_worker_push_duration_seconds_count") == 0  # the push alone: no separate push here
    assert value(w, "ps_worker_pull_duration_seconds_count") == 1
    assert math.isfinite(value(w, "ps_worker_loss")) and value(w, "ps_worker_loss") > 0
    # Both sides count serialized message bytes, so they agree exactly.
    sent = value(s, "ps_received_bytes_total", method=INIT) + value(s, "ps_received_bytes_total", method=PUSH_PULL)
    assert value(w, "ps_worker_sent_bytes_total") == sent
    received = value(s, "ps_sent_bytes_total", method=PULL) + value(s, "ps_sent_bytes_total", method=PUSH_PULL)
    assert value(w, "ps_worker_received_bytes_total") == received

    promtool_check(promtool, shard_text)
    promtool_check(promtool, worker_text)


def push_stream(*messages: ps_pb2.PushRequest):
    yield from messages


def test_refused_pushes_are_counted_by_code_and_reason(start_cluster) -> None:
    (shard,) = start_cluster(1, num_workers=1)
    with grpc.insecure_channel(shard.address) as channel:
        stub = ps_pb2_grpc.ParameterServiceStub(channel)
        bad = ps_pb2.PushRequest(partition=ps_pb2.Partition(key="nope", length=1))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Push(push_stream(bad), timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        header = ps_pb2.PushRequest(header=ps_pb2.PushHeader(rank=0, clock=0))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Push(push_stream(header), timeout=5)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # not initialized
        # The shard keeps serving.
        stub.Join(ps_pb2.JoinRequest(rank=0, num_workers=1, incarnation=1), timeout=5)

    s = samples(scrape(shard.metrics_url))
    assert value(s, "ps_rpc_duration_seconds_count", method=PUSH, code="INVALID_ARGUMENT") == 1
    assert value(s, "ps_rpc_duration_seconds_count", method=PUSH, code="FAILED_PRECONDITION") == 1
    assert value(s, "ps_rpc_duration_seconds_count", method="ps.v1.ParameterService/Join", code="OK") == 1
    assert value(s, "ps_rejected_pushes_total", reason="invalid_argument") == 1
    assert value(s, "ps_rejected_pushes_total", reason="failed_precondition") == 1
    assert value(s, "ps_pushes_total", mode="sync") == 0
    assert value(s, "ps_received_bytes_total", method=PUSH) == bad.ByteSize() + header.ByteSize()
    assert value(s, "ps_workers", state="live") == 1
    assert value(s, "ps_workers", state="pending") == 0


def test_token_refusals_are_counted(start_cluster) -> None:
    (shard,) = start_cluster(1, num_workers=1, token="worker-secret", admin_token="admin-secret")
    with grpc.insecure_channel(shard.address) as channel:
        stub = ps_pb2_grpc.ParameterServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Push(push_stream(ps_pb2.PushRequest(header=ps_pb2.PushHeader())), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        admin = ps_pb2_grpc.AdminStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            admin.GetStatus(ps_pb2.GetStatusRequest(), timeout=5, metadata=(("authorization", "Bearer worker-secret"),))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    s = samples(scrape(shard.metrics_url))
    assert value(s, "ps_rejected_pushes_total", reason="unauthenticated") == 1
    assert value(s, "ps_rpc_duration_seconds_count", method=PUSH, code="UNAUTHENTICATED") == 1
    assert value(s, "ps_rpc_duration_seconds_count", method="ps.v1.Admin/GetStatus", code="PERMISSION_DENIED") == 1


def test_metrics_port_in_use_is_a_clear_error(start_cluster) -> None:
    (shard,) = start_cluster(1, num_workers=1)
    with pytest.raises(RuntimeError, match="--metrics-port 0"):
        start_cluster(1, num_workers=1, metrics_port=shard.metrics_endpoint.port)
