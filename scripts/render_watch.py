"""Draw README's "Watching a job" pictures from a real job: the Grafana dashboard's panels over a real
Prometheus's answers (``docs/img/dashboard.png``) and the TensorBoard curves of ``ps-launch
--tensorboard`` (``docs/img/tensorboard.png``).

    python scripts/render_watch.py                 # a 2 x 2 ctr job of about 2 minutes; writes docs/img/
    python scripts/render_watch.py --steps 300 --out /tmp/img

It needs ``prometheus`` on PATH (Debian's package, as the tests use) and matplotlib (the ``dev`` or
``bench`` extra). Grafana does not install offline, so the dashboard is drawn with matplotlib from
``deploy/grafana/grpc-ps.json`` itself: every panel at its ``gridPos`` (24 columns), every target's
``query_range`` over the job, series named by the target's ``legendFormat``, the y axis in the
panel's unit. ``tests/integration/test_grafana_dashboard.py`` and ``tests/e2e/test_tensorboard.py``
draw both from their jobs, so this file is exercised in CI.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "grpc-ps.json"
SUBSTITUTIONS = {"$__rate_interval": "30s", "$job": ".*", "$instance": ".*", "$worker_job": ".*"}
"""What Grafana puts in place of each variable: "All" of a variable is its ``allValue`` (``.*``)."""
TAGS = (
    ("train/loss", "training loss (mean since the previous point)"),
    ("train/step_seconds", "step time (s)"),
    ("train/staleness", "staleness of the pushes (versions)"),
    ("comm/pushed_bytes", "bytes pushed"),
    ("comm/pulled_bytes", "bytes pulled"),
    ("train/lr_pushed", "learning rate"),
)
"""The TensorBoard scalars drawn (``ps_worker.tensorboard``) in this order, the first :data:`PANELS`
that the runs have (sync writes no staleness), one panel each, a line per rank."""
PANELS = 4
SCORES = ("accuracy", "auc", "bits_per_char", "loss")
"""Held-out scores (``eval/NAME``) shown in the title, the ones a run has."""
UNITS = {"s": "seconds", "ops": "per second", "reqps": "requests/s", "Bps": "bytes/s", "bytes": "bytes"}


def dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def all_panels(d: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows and the panels of collapsed rows included."""
    for p in d["panels"]:
        yield p
        yield from p.get("panels", [])


def promql(text: str) -> str:
    """``text`` with Grafana's variables replaced by what Grafana sends for "All".

    Raises:
        ValueError: a variable this file does not know.
    """
    for name, value in sorted(SUBSTITUTIONS.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(name, value)
    if "$" in text:
        raise ValueError(f"an unknown Grafana variable in {text!r}")
    return text


QUERY_ATTEMPTS = 3
"""Tries of one range query while Prometheus does not answer (busy: a timeout, or 503) before a panel is
drawn empty; 10 s each, 0.5 s apart."""


def query_range(base: str, query: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    """The ``matrix`` result of a range query (Unix seconds); [] when Prometheus did not answer in
    :data:`QUERY_ATTEMPTS` tries (the panel is drawn empty).

    Raises:
        RuntimeError: Prometheus refused the query (HTTP 400/422), with its reason.
    """
    args = {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
    for attempt in range(QUERY_ATTEMPTS):
        if attempt:
            time.sleep(0.5)  # Prometheus was busy: let it catch up, a bounded number of times
        try:
            with urllib.request.urlopen(f"{base}/api/v1/query_range?" + urllib.parse.urlencode(args), timeout=10) as r:
                return json.load(r)["data"]["result"]
        except urllib.error.HTTPError as exc:
            if exc.code != 503:
                raise RuntimeError(f"{query}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]}") from exc
        except OSError:
            pass
    print(f"render_watch: no answer from Prometheus to {query!r} in {QUERY_ATTEMPTS} tries", file=sys.stderr)
    return []


def legend(fmt: str, metric: dict[str, str]) -> str:
    """A series' name: ``legendFormat`` with ``{{label}}`` filled in, else its labels."""
    if fmt and fmt != "__auto":
        name = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m[1], ""), fmt).strip()
        if name:
            return name
    labels = {k: v for k, v in metric.items() if k not in ("__name__", "job")}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or metric.get("__name__", "value")


def render_dashboard(base: str, start: float, end: float, out: Path, d: dict[str, Any] | None = None) -> dict[str, int]:
    """Draw every panel of dashboard ``d`` (default: deploy/grafana/grpc-ps.json) over [start, end]
    (Unix seconds) from the Prometheus at ``base`` into the PNG ``out``.

    Returns:
        Panel title -> number of series drawn (0: the panel had no data).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = d or dashboard()
    panels = list(all_panels(d))
    headers = sorted(p["gridPos"]["y"] for p in panels if p["type"] == "row")

    def at(y: int) -> int:  # the figure's grid row of the dashboard's row y: a blank one above each header
        return y + sum(1 for h in headers if h <= y)

    rows = max(at(p["gridPos"]["y"]) + p["gridPos"]["h"] for p in panels)
    step = max(1.0, (end - start) / 300)
    # Prometheus evaluates a range query at start, start + step, ... <= end: the grid is laid from
    # ``end`` back, so its last point is ``end`` itself and the picture ends on what an instant
    # query showed then (a grid laid from ``start`` can end up to a step earlier, before a rate's
    # second sample: an empty panel for a job of a few seconds).
    first = end - ((end - start) // step) * step
    fig = plt.figure(figsize=(18, rows * 0.2), facecolor="#111217")
    grid = fig.add_gridspec(rows, 24, hspace=2.5, wspace=1.2, left=0.04, right=0.99, top=0.985, bottom=0.01)
    drawn: dict[str, int] = {}
    for p in panels:
        g = p["gridPos"]
        if p["type"] == "row":
            header = fig.add_subplot(grid[at(g["y"]), :])
            header.axis("off")
            header.text(0, 0, p["title"], color="#d8d9da", fontsize=13, weight="bold", transform=header.transAxes)
            continue
        top = at(g["y"]) + 1  # a grid row for the title
        ax = fig.add_subplot(grid[top : at(g["y"]) + g["h"], g["x"] : g["x"] + g["w"]], facecolor="#181b1f")
        count = 0
        for t in p.get("targets", []):
            for series in query_range(base, promql(t["expr"]), first, end, step):
                points = [(float(ts) - start, float(v)) for ts, v in series["values"] if math.isfinite(float(v))]
                if not points:
                    continue
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, linewidth=1.2, label=legend(t.get("legendFormat", ""), series["metric"])[:40])
                count += 1
        drawn[p["title"]] = count
        ax.set_title(p["title"], color="#d8d9da", fontsize=9, loc="left")
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit")
        ax.set_ylabel(UNITS.get(unit or "", ""), color="#8e8e8e", fontsize=7)
        ax.tick_params(colors="#8e8e8e", labelsize=7)
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        if count:
            ax.legend(fontsize=6, loc="upper left", framealpha=0.3, ncol=2 if count > 3 else 1)
        else:
            ax.text(0.5, 0.5, "No data", color="#8e8e8e", ha="center", va="center", transform=ax.transAxes)
    fig.text(0.99, 0.002, "seconds since the job started", color="#8e8e8e", fontsize=7, ha="right")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())
    plt.close(fig)
    return drawn


def render_tensorboard(log_dir: Path, out: Path) -> dict[str, int]:
    """Draw :data:`TAGS` of every ``log_dir/rank-R`` run (TensorBoard's own reader) into the PNG ``out``,
    a line per rank; the held-out :data:`SCORES` of each rank go in the title.

    Returns:
        Tag -> number of ranks drawn, for the tags drawn.

    Raises:
        ValueError: no run has any of the tags.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = {}
    for run in sorted(log_dir.glob("rank-*"), key=lambda r: int(r.name.split("-")[1])):
        acc = EventAccumulator(str(run))
        acc.Reload()
        runs[run.name] = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    tags = [(tag, title) for tag, title in TAGS if any(s.get(tag) for s in runs.values())][:PANELS]
    if not tags:
        raise ValueError(f"no run in {log_dir} has any of {[tag for tag, _ in TAGS]}")
    fig, axes = plt.subplots(1, len(tags), figsize=(4 * len(tags), 3.2), squeeze=False)
    drawn: dict[str, int] = {}
    for ax, (tag, title) in zip(axes[0], tags, strict=True):
        drawn[tag] = 0
        for name, scalars in runs.items():
            if scalars.get(tag):
                ax.plot(*zip(*scalars[tag], strict=True), label=name, linewidth=1.2)
                drawn[tag] += 1
        ax.set_title(f"{tag}\n{title}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if drawn[tag]:
            ax.legend(fontsize=7)
    scores = [
        f"{name}: "
        + ", ".join(f"{score} {s[f'eval/{score}'][-1][1]:.4g}" for score in SCORES if s.get(f"eval/{score}"))
        for name, s in runs.items()
    ]
    fig.suptitle("held-out at the end: " + "; ".join(scores), fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return drawn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where the two PNGs go")
    p.add_argument("--steps", type=int, default=1500, help="steps of the ctr job (about 2 minutes on 2 cores)")
    p.add_argument("--prometheus", default="prometheus", help="the Prometheus binary")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="render-watch-"))
    lines = ["global:", "  scrape_interval: 1s", "scrape_configs:"]
    for job in ("ps", "worker"):
        (work / f"{job}.json").write_text("[]")
        lines += [f"  - job_name: {job}", "    file_sd_configs:", f"      - files: ['{work / job}.json']"]
    (work / "prometheus.yml").write_text("\n".join(lines) + "\n")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with open(work / "prometheus.log", "wb") as log:
        prom = subprocess.Popen(
            [args.prometheus, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, cwd=work,
        )  # fmt: skip
    job = None
    try:
        argv_job = [sys.executable, "-m", "ps_launch.cli", "--shards", "2", "--workers", "2", "--mode", "sync"]
        argv_job += ["--optimizer", "adagrad", "--lr", "0.05", "--batch-size", "256", "--steps", str(args.steps)]
        argv_job += ["--checkpoint-every", "100", "--no-progress", "--log-dir", str(work / "job")]
        argv_job += ["--tensorboard", str(work / "tb"), "ctr"]
        stderr = work / "ps-launch.stderr"
        started = time.time()
        with open(stderr, "wb") as err:
            job = subprocess.Popen(argv_job, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job.poll() is None:
            urls = dict(re.findall(r"ps-launch: (\S+) metrics on http://(\S+)/metrics", stderr.read_text()))
            if len(urls) == 4:
                for name, prefix in (("ps", "shard"), ("worker", "worker")):
                    (work / f"{name}.json").write_text(
                        json.dumps([{"targets": [urls[f"{prefix}-{k}"] for k in (0, 1)]}])
                    )
                break
            time.sleep(0.5)
        if job.wait(timeout=1800) != 0:
            print(stderr.read_text()[-3000:], file=sys.stderr)
            return 1
        end = time.time()
        panels = render_dashboard(base, started, end, args.out / "dashboard.png")
        tags = render_tensorboard(work / "tb", args.out / "tensorboard.png")
    finally:
        if job is not None:
            _stop(job, signal.SIGINT)
        _stop(prom)
    empty = [title for title, n in panels.items() if not n]
    print(f"render-watch: {args.out / 'dashboard.png'} ({len(panels)} panels, without data: {empty or 'none'}), "
          f"{args.out / 'tensorboard.png'} ({tags}); the job's files are in {work}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
