"""Tracing is best effort (issue 43): a collector that accepts TCP connections and never answers
costs a step nothing, logs one WARNING, and the end-of-process flush is bounded."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ps_common import tracing

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys, time
from ps_common import tracing

tracing.configure(sys.argv[1], "probe")

def burst(n):
    began = time.perf_counter()
    for i in range(n):
        with tracing.span("step", step=i):
            pass
    return (time.perf_counter() - began) / n

first = burst(600)            # past a batch (512): the exporter's thread tries the black hole
time.sleep(tracing.EXPORT_TIMEOUT_SECONDS + 1.0)  # let that export time out: exports are paused after it
during = burst(5000)          # more than the queue holds (2048): dropped quietly while paused
began = time.perf_counter()
tracing.shutdown()
print(json.dumps({"first": first, "during": during, "shutdown": time.perf_counter() - began}))
"""


@pytest.fixture
def black_hole() -> Iterator[str]:
    """An OTLP endpoint that accepts TCP (the kernel's backlog) but never reads or answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_collector_that_never_answers_costs_one_warning_and_a_bounded_exit(black_hole: str, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    began = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, black_hole], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    wall = time.monotonic() - began
    assert out.returncode == 0, out.stderr[-3000:]
    said = json.loads(out.stdout.strip().splitlines()[-1])
    warnings = [line for line in out.stderr.splitlines() if "could not be exported" in line]
    assert len(warnings) == 1, out.stderr[-3000:]
    assert black_hole in warnings[0] and "training goes on" in warnings[0]
    others = [line for line in out.stderr.splitlines() if line not in warnings]
    assert not [line for line in others if "Queue full" in line or "export" in line], out.stderr[-3000:]
    # a span costs what it costs: no step waits on the exporter (loaded 2-core machine: generous bounds)
    assert said["during"] < 1e-3, said
    assert said["shutdown"] <= tracing.SHUTDOWN_SECONDS + 0.5, said
    # start-up of the interpreter and the SDK, the paced sleep, and an exit that waits on nothing
    assert wall < 30, (wall, said)
