"""``bench/run.py --quick`` runs to the end and measures every system (benchmarks are not tests:
the numbers themselves are not checked, only that each one is there, positive and finite)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = {"memcpy", "tcp", "echo", "gloo", "rpc", "grpc-ps", "native"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_bench_measures_every_system(tmp_path) -> None:
    """Also ``--before``: each grpc-ps configuration runs a second checkout's code (a clone of this
    commit here) in the same rounds, with the speed-up and each side's CPU time (float32 on the
    wire only: the twins take the time bf16's configurations took)."""
    out_json = tmp_path / "bench.json"
    before = tmp_path / "before"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(before)], check=True, timeout=120)
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--json", str(out_json), "--before", str(before)]
        + ["--wire-dtypes", "float32"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out_json.read_text())
    assert report["meta"]["glibc_tunables"].startswith("glibc.malloc.hugetlb=1")
    results = report["results"]
    assert {r["family"] for r in results} == FAMILIES
    for r in results:
        samples = [s for round_ in r["rounds"] for s in round_]
        assert len(r["rounds"]) == report["meta"]["rounds"] and samples, r["system"]
        assert all(math.isfinite(s) and s > 0 for s in samples), r["system"]
        assert math.isfinite(r["median"]) and r["median"] > 0, r["system"]
    systems = {r["system"] for r in results}
    assert {"grpc-ps 1w×1s", "grpc-ps 2w×2s", "rpc PS 1w", "rpc PS 2w", "grpc echo", "grpc-ps 1w×1s plain"} <= systems
    assert {q["name"][:3] for q in report["ratios"] if "before / now" not in q["name"]} == {"(1)", "(2)", "(4)"}
    plain = next(q for q in report["ratios"] if "started plainly" in q["name"])
    assert math.isfinite(plain["value"]) and plain["value"] > 0
    assert "GLIBC_TUNABLES=" in out.stdout
    assert {"grpc-ps 1w×1s before", "grpc-ps 2w×2s before"} <= systems and "grpc-ps 1w×1s plain before" not in systems
    speedups = [q for q in report["ratios"] if "before / now" in q["name"]]
    assert any(q["name"].startswith("grpc-ps 2w×2s: before / now") for q in speedups), speedups
    assert all(math.isfinite(q["value"]) and q["value"] > 0 for q in speedups)
    for r in results:
        sides = r["cpu_seconds_per_step_by_side"]
        if r["family"] == "grpc-ps":  # each side ran Python every step: no side's CPU time is zero
            assert set(sides) == {"workers", "shards"} and all(v > 0 for vs in sides.values() for v in vs), r
        else:
            assert sides == {}, r
    assert "CPU ms: workers" in out.stdout


def _step_calls(data_path: str) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step_calls.py"), "--steps", "30", "--warmup", "10"]
        + ["--data-path", data_path, "--modules"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("Python function calls per step")]
    worker, shards = (float(x.split()[-1]) for x in line.split(":", 1)[1].split(","))
    lines = [x.split(":") for x in out.stdout.splitlines() if x.startswith("modules run per step by the")]
    modules = {side.split()[-1]: names.split() for side, _, names in lines}
    assert "ps_worker/client.py" in modules["worker"] and "ps_server/shard/data_calls.py" in modules["shards"]
    assert not any(m.startswith("ps_server/") for m in modules["worker"]), modules  # the sides apart
    return worker, shards


@pytest.mark.timeout(300)
def test_step_calls_counts_each_side_of_a_step_the_same_every_run() -> None:
    """``bench/step_calls.py`` charges the shard's threads (its data connection's too) to the shard
    and gives about the same counts on a second run; gRPC's server-side Python shows on the shard."""
    first, again = _step_calls("tcp"), _step_calls("tcp")
    assert first[0] > 50 and first[1] > 100, first  # both sides run Python every step
    # heartbeats and the lease reaper run on time, not per step: a few calls of 30 steps
    assert all(abs(a - b) <= 0.1 * a for a, b in zip(first, again, strict=True)), (first, again)
    grpc = _step_calls("grpc")
    assert grpc[1] > first[1], (grpc, first)  # interceptors and the servicer's stream reading
