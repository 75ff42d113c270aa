"""OpenTelemetry traces (docs/operations.md#tracing-opentelemetry): a real job exports to a real
OTLP/gRPC collector, and with tracing off nothing of opentelemetry is imported."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

LAUNCH = [sys.executable, "-m", "ps_launch.cli"]
STEPS = 4


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector on 127.0.0.1:0 that keeps every span with its service name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.shard_of: dict[bytes, int] = {}  # span id -> ps.shard_index of the shard that sent it
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (the generated method name)
        with self.lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value for a in rs.resource.attributes}
                spans = [s for ss in rs.scope_spans for s in ss.spans]
                self.spans.extend((attrs["service.name"].string_value, s) for s in spans)
                if "ps.shard_index" in attrs:
                    self.shard_of.update((s.span_id, attrs["ps.shard_index"].int_value) for s in spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    c = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(c, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    c.url = f"http://127.0.0.1:{port}"
    yield c
    server.stop(None)


def launch(tmp_path, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | (env or {})
    return subprocess.run(
        [*LAUNCH, "--shards", "2", "--workers", "1", "--steps", str(STEPS), "--no-progress", "--json"]
        + ["--no-metrics", "--log-dir", str(tmp_path), *flags, "digits"],
        capture_output=True,
        text=True,
        timeout=180,
        env=environ,
    )


@pytest.mark.parametrize("data_path", ["tcp", "grpc"])
def test_a_step_is_one_trace_from_the_worker_to_both_shards(tmp_path, collector, data_path) -> None:
    out = launch(tmp_path, "--otel-endpoint", collector.url, env={"PS_DATA_PATH": data_path})
    assert out.returncode == 0, out.stderr
    # every process flushes at its end: the spans are in once ps-launch returned
    by_id = {s.span_id: (service, s) for service, s in collector.spans}
    steps = [s for service, s in by_id.values() if s.name == "step" and service == "ps-worker"]
    assert len(steps) == STEPS, sorted({s.name for _, s in by_id.values()})
    last = steps[-1]
    trace = [(service, s) for service, s in by_id.values() if s.trace_id == last.trace_id]
    (push_pull,) = [s for service, s in trace if s.name == "push_pull"]
    assert push_pull.parent_span_id == last.span_id
    rpcs = [s for service, s in trace if service == "ps-server" and s.name.startswith("ps.v1.ParameterService/")]
    # one PushPull(Once) per shard, each the child of the worker's push_pull span
    assert len(rpcs) == 2, [(svc, s.name) for svc, s in trace]
    assert all(s.parent_span_id == push_pull.span_id for s in rpcs)
    assert {collector.shard_of[s.span_id] for s in rpcs} == {0, 1}
    # tcp: the small model's PushPullOnce goes whole on the data connections, its context in
    # PushHeader.traceparent; grpc: in the call's metadata, read by the shard's interceptor
    paths = {next((a.value.string_value for a in s.attributes if a.key == "ps.path"), "grpc") for s in rpcs}
    assert paths == {"data connection" if data_path == "tcp" else "grpc"}

    def descendants(root) -> set[str]:
        names, frontier = set(), {root.span_id}
        while frontier:
            children = [s for _, s in trace if s.parent_span_id in frontier]
            names |= {s.name for s in children}
            frontier = {s.span_id for s in children}
        return names

    for rpc in rpcs:  # sync, one worker: every push closes the round on its shard
        assert {"push", "optimizer_step", "pull", "round_wait"} <= descendants(rpc), descendants(rpc)


def test_a_collector_that_never_answers_costs_each_process_one_warning(tmp_path) -> None:
    """--otel-endpoint at a black hole (a socket that listens and never accepts): the job trains to
    the end; every shard and the worker say so once, and none logs a line per failed export or span.
    The bound on the exit's flush: tests/integration/test_tracing_black_hole.py."""
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(64)
        began = time.monotonic()
        out = launch(tmp_path, "--otel-endpoint", f"http://127.0.0.1:{hole.getsockname()[1]}")
        took = time.monotonic() - began
    assert out.returncode == 0, out.stderr[-3000:]
    for name in ("worker-0", "shard-0", "shard-1"):
        log = (tmp_path / f"{name}.log").read_text()
        (said,) = [line for line in log.splitlines() if "could not be exported" in line]  # the exit's flush, at last
        assert "training goes on" in said
        assert "Queue full" not in log and "Failed to export" not in log.replace(said, ""), log[-3000:]
    assert took < 150, f"took {took:.0f} s"  # an unbounded flush added 16-30 s per process


def test_off_by_default_imports_nothing_of_opentelemetry(tmp_path) -> None:
    """A single-process job (shard and worker in one process) with no --otel-endpoint and no OTEL_*:
    no opentelemetry module is loaded, and no tracing interceptor is installed."""
    script = (
        "import sys, torch\n"
        "from ps_worker import DistributedOptimizer, PSClient\n"
        "model = torch.nn.Linear(4, 2)\n"
        "client = PSClient.from_env(model, optimizer={'name': 'sgd', 'lr': 0.1})\n"
        "opt = DistributedOptimizer(model, client)\n"
        "for _ in range(3):\n"
        "    opt.zero_grad(); model(torch.ones(8, 4)).sum().backward(); opt.step()\n"
        "client.close()\n"
        "import ps_common.tracing as t\n"
        "print(t.enabled(), sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PS_"))}
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=environ)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False []", (out.stdout, time.monotonic() - started)


def test_endpoint_without_the_package_fails_fast_naming_the_extra(tmp_path) -> None:
    """--otel-endpoint where opentelemetry cannot be imported: ps-launch refuses before it starts anything."""
    blocker = tmp_path / "block"
    (blocker / "opentelemetry").mkdir(parents=True)
    (blocker / "opentelemetry" / "__init__.py").write_text("raise ImportError('opentelemetry blocked for this test')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])}
    out = launch(tmp_path, "--otel-endpoint", "http://127.0.0.1:9", env=env)
    assert out.returncode == 2, out.stderr
    assert "pip install 'grpc-ps[otel]'" in out.stderr
    assert "started" not in out.stderr
