"""deploy/grafana/grpc-ps.json: a well-formed Grafana dashboard whose every query is valid PromQL for a real
Prometheus and returns data from a running 2-shard x 2-worker job (ps-launch) that Prometheus scrapes."""

from __future__ import annotations

import json
import math
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.scripts import load_script

render_watch = load_script("render_watch")
DASHBOARD = render_watch.DASHBOARD
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
LABEL_VALUES = re.compile(r"label_values\((?:(?P<metric>.+), )?(?P<label>\w+)\)")
JOB_DEADLINE = 120.0
"""Seconds for ps-launch to start and every query to return data (about 40 s on a loaded 2-core machine)."""
dashboard, all_panels, promql = render_watch.dashboard, render_watch.all_panels, render_watch.promql


def queries(d: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target, and of every query variable (``label_values(m, l)`` runs as
    ``count by (l) (m)``, which returns a series per value Grafana would list)."""
    found = [
        (f"panel {p['title']!r} target {t['refId']}", promql(t["expr"]))
        for p in all_panels(d)
        for t in p.get("targets", [])
    ]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            m = LABEL_VALUES.fullmatch(v["definition"])
            assert m and m["metric"], (
                f"variable {v['name']}: expected label_values(METRIC, LABEL), got {v['definition']!r}"
            )
            found.append((f"variable ${v['name']}", promql(f"count by ({m['label']}) ({m['metric']})")))
    return found


def test_the_dashboard_is_well_formed() -> None:
    d = dashboard()
    assert d["uid"] == "grpc-ps" and d["schemaVersion"] >= 39 and d["id"] is None
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == DATASOURCE, v["name"]
            assert v["includeAll"] and v["allValue"] == ".*", v["name"]  # what render_watch.SUBSTITUTIONS assume
    panels = list(all_panels(d))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {sorted(ids)}"
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh") and g["w"] > 0 and g["h"] > 0, p["title"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, f"panel {p['title']!r} is wider than the grid"
        for cell in ((x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])):
            assert cell not in cells, f"panels {p['title']!r} and {cells[cell]!r} overlap"
            cells[cell] = p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == DATASOURCE, p["title"]
        targets = p["targets"]
        assert targets and len({t["refId"] for t in targets}) == len(targets), p["title"]
        for t in targets:
            assert t["datasource"] == DATASOURCE and t["expr"].strip(), p["title"]
    refs = re.findall(r'"datasource":\s*(\{[^{}]*\})', DASHBOARD.read_text())
    hard_coded = [r for r in map(json.loads, refs) if r.get("type") != "grafana" and r != DATASOURCE]
    assert not hard_coded, f"data sources not through ${{datasource}}: {hard_coded}"
    used = set(re.findall(r"\$(\w+)", json.dumps([t["expr"] for p in panels for t in p.get("targets", [])])))
    assert used <= set(variables) | {"__rate_interval"}, used


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(base: str, query: str) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of an instant query; (0, {}) while Prometheus does not answer."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        if exc.code == 503:  # starting up
            return 0, {}
        return exc.code, json.loads(text) if text.startswith("{") else {"error": text}
    except OSError:
        return 0, {}


@pytest.fixture
def prometheus(tool, tmp_path: Path, wait_until) -> Iterator[Callable[[list[str]], str]]:
    """``start(jobs)``: a real Prometheus on a free port scraping, every second, the targets listed in
    ``tmp_path/JOB.json`` (file service discovery, read again when the file changes) for each job; returns
    its base URL once it is ready. Ended by its PID at teardown."""
    binary = tool("prometheus")
    procs: list[subprocess.Popen[bytes]] = []

    def start(jobs: list[str]) -> str:
        lines = ["global:", "  scrape_interval: 1s", "  evaluation_interval: 1s", "scrape_configs:"]
        for job in jobs:
            (tmp_path / f"{job}.json").write_text("[]")
            lines += [f"  - job_name: {job}", "    file_sd_configs:", f"      - files: ['{tmp_path / job}.json']"]
        (tmp_path / "prometheus.yml").write_text("\n".join(lines) + "\n")
        port = free_port()
        with open(tmp_path / "prometheus.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        binary,
                        f"--config.file={tmp_path / 'prometheus.yml'}",
                        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{port}",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=tmp_path,
                )
            )
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: ask(base, "1")[0] == 200 or procs[-1].poll() is not None, 30, "Prometheus to serve")
        assert procs[-1].poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
        return base

    yield start
    for p in procs:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def test_every_query_is_valid_promql(prometheus) -> None:
    """Prometheus answers a query that does not parse (or mixes types) with HTTP 400 and says why."""
    base = prometheus([])
    bad = []
    for where, query in queries(dashboard()):
        status, body = ask(base, query)
        if status != 200:
            bad.append(f"{where}: {query}\n    -> HTTP {status}: {body.get('error')}")
    assert not bad, "queries Prometheus refuses:\n" + "\n".join(bad)


def has_data(result: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(r["value"][1])) for r in result)


def test_every_query_returns_data_from_a_running_2x2_job(prometheus, tmp_path: Path) -> None:
    """A sync ``ctr`` job (dense layers and embedding tables, checkpoints every 20 versions) of 2 shards and
    2 workers, long enough to outlast the test, stopped with SIGINT at the end. The step rate has a line per
    rank and the bytes a line per shard."""
    started, started_at = time.monotonic(), time.time()
    base = prometheus(["ps", "worker"])
    argv = [sys.executable, "-m", "ps_launch.cli", "--shards", "2", "--workers", "2", "--mode", "sync"]
    argv += ["--optimizer", "adagrad", "--lr", "0.05", "--batch-size", "64", "--steps", "1000000"]
    argv += ["--checkpoint-every", "20", "--no-progress", "--log-dir", str(tmp_path / "job"), "ctr"]
    stderr = tmp_path / "ps-launch.stderr"
    with open(stderr, "wb") as err:
        job = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
    pending = dict((query, where) for where, query in queries(dashboard()))
    by_title = {p["title"]: promql(p["targets"][0]["expr"]) for p in all_panels(dashboard()) if p["type"] != "row"}
    one_per_process = {by_title["Steps/s per rank"], by_title["Bytes received/s per shard"]}
    try:
        written = False
        while pending and time.monotonic() - started < JOB_DEADLINE and job.poll() is None:
            if not written:
                urls = dict(re.findall(r"ps-launch: (\S+) metrics on http://(\S+)/metrics", stderr.read_text()))
                if len(urls) == 4:
                    for job_name, prefix in (("ps", "shard"), ("worker", "worker")):
                        targets = [urls[f"{prefix}-{k}"] for k in range(2)]
                        (tmp_path / f"{job_name}.json").write_text(json.dumps([{"targets": targets}]))
                    written = True
            for query in list(pending):
                status, body = ask(base, query)
                assert status in (0, 200), f"{pending[query]}: {query} -> HTTP {status}: {body.get('error')}"
                result = body["data"]["result"] if status == 200 else []
                if has_data(result) and (query not in one_per_process or len(result) == 2):
                    del pending[query]
            time.sleep(0.5)  # polling interval, with a deadline above
        assert job.poll() is None, f"ps-launch exited {job.returncode}:\n{stderr.read_text()[-3000:]}"
        if not pending:  # README's dashboard picture is drawn so (scripts/render_watch.py): every panel has lines
            drawn = render_watch.render_dashboard(base, started_at, time.time(), tmp_path / "dashboard.png")
            assert drawn.keys() == {p["title"] for p in all_panels(dashboard()) if p["type"] != "row"}
            assert all(drawn.values()), f"panels drawn without data: {[t for t, n in drawn.items() if not n]}"
    finally:
        job.send_signal(signal.SIGINT)
        try:
            job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait(timeout=10)
    missing = "\n".join(f"{where}: {query}" for query, where in pending.items())
    assert not pending, f"no data after {JOB_DEADLINE:.0f} s from:\n{missing}\nps-launch:\n{stderr.read_text()[-2000:]}"
