"""A real Prometheus scrapes two shards and a worker of a live run and answers PromQL about them."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from ps_common.metrics_endpoint import serve_metrics
from ps_worker.metrics import WorkerMetrics

DEADLINE = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def target(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


def query(base: str, promql: str) -> list[dict]:
    """The vector result of an instant query ([] while Prometheus is not ready)."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = json.load(reply)
    except OSError:
        return []
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture
def prometheus(tool, tmp_path: Path):
    """``start(jobs)`` runs Prometheus on a free 127.0.0.1 port scraping ``{job: [host:port]}`` every
    second; returns its base URL. Ended by its PID at teardown."""
    binary = tool("prometheus")
    procs: list[subprocess.Popen[bytes]] = []

    def start(jobs: dict[str, list[str]]) -> str:
        lines = ["global:", "  scrape_interval: 1s", "  evaluation_interval: 1s", "scrape_configs:"]
        for job, targets in jobs.items():
            lines += [f"  - job_name: {job}", "    static_configs:", f"      - targets: {json.dumps(targets)}"]
        config = tmp_path / "prometheus.yml"
        config.write_text("\n".join(lines) + "\n")
        port = free_port()
        log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
            )
        )
        log.close()
        return f"http://127.0.0.1:{port}"

    yield start
    for p in procs:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def test_prometheus_scrapes_a_live_run(start_cluster, start_trainer, prometheus, wait_until, tmp_path) -> None:
    shards = start_cluster(2, num_workers=1)
    worker = WorkerMetrics(CollectorRegistry())
    endpoint = serve_metrics(worker.registry, "127.0.0.1", 0)
    try:
        trainer = start_trainer([s.address for s in shards], metrics=worker, pace=0.02)
        wait_until(lambda: trainer.steps > 0 or trainer.error, 30, "the first step")
        assert trainer.error is None, trainer.error
        base = prometheus(
            {"ps": [target(s.metrics_url) for s in shards], "worker": [target(endpoint.url)]},
        )

        def answered(promql: str, n: int):
            def check():
                result = query(base, promql)
                return result if len(result) == n and all(float(r["value"][1]) > 0 for r in result) else None

            try:
                return wait_until(check, DEADLINE, f"Prometheus to answer {promql!r} with {n} non-zero series")
            except pytest.fail.Exception:
                print((tmp_path / "prometheus.log").read_text()[-3000:])
                raise

        assert len(answered('up{job="ps"}', 2)) == 2
        versions = answered("ps_model_version", 2)
        assert {r["metric"]["instance"] for r in versions} == {target(s.metrics_url) for s in shards}
        rates = answered(
            'sum by (instance) (rate(ps_received_bytes_total{method=~"ps.v1.ParameterService/PushPull(Once)?"}[30s]))',
            2,
        )
        assert all(float(r["value"][1]) > 0 for r in rates)
        answered('rate(ps_worker_sent_bytes_total{job="worker"}[30s])', 1)
        answered("ps_worker_push_pull_duration_seconds_count", 1)
        assert trainer.error is None
        trainer.stop()
        assert trainer.steps > 0
    finally:
        endpoint.close()
