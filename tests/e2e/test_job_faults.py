"""Job-level faults through the real commands: a finished job run again, a rank that never joins, a
malformed shard address, and JSON that any parser reads.

Every process runs under a timeout; a test that outlives it fails and kills only the process it
started. Runs are small (one shard, digits, --steps 10..20) for CI's two cores.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

PY = sys.executable
LAUNCH = [PY, "-m", "ps_launch.cli", "--shards", "1", "--workers", "2", "--no-progress", "--no-metrics"]


def strict_json(line: str) -> dict:
    """``json.loads`` that refuses NaN and Infinity, as jq and JavaScript do."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"not valid JSON: {constant} in {line[:200]}")

    return json.loads(line, parse_constant=refuse)


def run(argv: list[str], timeout: float, **kwargs) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``argv``; fail the test (the child killed) when it outlives ``timeout`` seconds."""
    start = time.monotonic()
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{argv[2:4]} still running after {timeout:.0f} s: {str(exc.stderr)[-2000:]}")
    return out, time.monotonic() - start


@pytest.mark.parametrize(
    ("address", "complaint"),
    [
        ("127.0.0.1:", "has no port after ':'"),
        ("127.0.0.1", "has no port"),
        ("127.0.0.1:notaport", "which is not a number"),
        ("127.0.0.1:70000", "outside 1..65535"),
    ],
)
def test_malformed_address_fails_at_once_naming_it(address: str, complaint: str) -> None:
    # before: ps-worker dialled "127.0.0.1:" and waited --timeout (60 s), then DEADLINE_EXCEEDED
    worker = [
        PY,
        "-m",
        "ps_worker.workloads.cli",
        "--servers",
        f"127.0.0.1:1,{address}",
        "--rank",
        "0",
        "--num-workers",
        "1",
    ]
    out, seconds = run([*worker, "--metrics-port", "-1", "--retry-deadline", "60", "digits"], timeout=50)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"--servers: Shard address {address!r}" in out.stderr and complaint in out.stderr, out.stderr
    assert seconds < 40  # start-up (torch import) on a loaded machine; no connection attempt
    admin, _ = run([PY, "-m", "ps_admin.cli", "--servers", address, "status"], timeout=50)
    assert admin.returncode == 2 and f"Shard address {address!r}" in admin.stderr, admin.stderr


def launch(log_dir: Path, steps: int, *extra: str, timeout: float = 240, env: dict | None = None):
    argv = [*LAUNCH, "--mode", "sync", "--steps", str(steps), "--log-dir", str(log_dir), "--json", *extra, "digits"]
    return run(argv, timeout=timeout, env=env)[0]


@pytest.mark.slow
def test_finished_job_run_again_says_nothing_to_do_and_more_steps_go_on_with_every_rank(tmp_path) -> None:
    first = launch(tmp_path, 10)
    assert first.returncode == 0, first.stderr[-3000:]
    assert strict_json(first.stdout.strip().splitlines()[-1])["version"] == 10
    # before: the same command trained 0 steps and printed "final_loss": NaN
    again = launch(tmp_path, 10)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"nothing to do: the job in {tmp_path} finished at version 10" in again.stdout, again.stdout
    assert "use a new --log-dir or raise --steps" in again.stdout
    said = strict_json(again.stdout.strip().splitlines()[-1])
    assert said["nothing_to_do"] is True and said["version"] == 10
    assert "started worker" not in again.stderr  # no worker was started for nothing
    # a hand-run (or compose) worker on the finished job's shards says so too, in strict JSON
    done = worker_on_checkpoints(tmp_path / "checkpoints", steps=10)
    assert done["final_loss"] is None and done["version"] == 10
    # before: the restored ranks were LEFT and not awaited; whichever rank joined first ran rounds alone
    more = launch(tmp_path, 20)
    assert more.returncode == 0, more.stderr[-3000:]
    s = strict_json(more.stdout.strip().splitlines()[-1])
    view = s["shards_view"]
    assert view["restored_from"] == [10] and s["version"] == 20
    assert view["pushes"] == [20, 20], view  # each rank pushed in every one of the 10 resumed rounds
    assert view["worker_states"] == ["left", "left"] and isinstance(s["final_loss"], float)


def worker_on_checkpoints(checkpoints: Path, steps: int) -> dict:
    """Rank 0 of 2 run with ``ps-worker`` against a ``ps-server`` resumed from ``checkpoints``; its
    summary (the last stdout line), after checking it warned that it had nothing to do."""
    server = subprocess.Popen(
        [PY, "-m", "ps_server.cli", "--shard-index", "0", "--num-shards", "1", "--num-workers", "2", "--port", "0"]
        + ["--metrics-port", "-1", "--checkpoint-dir", str(checkpoints)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in server.stdout], daemon=True).start()
        address = ""
        deadline = time.monotonic() + 60
        while not address:
            try:
                line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail("ps-server did not print its address within 60 s")
            if "listening on" in line:
                address = line.split("listening on ", 1)[1].strip()
        worker = [PY, "-m", "ps_worker.workloads.cli", "--servers", address, "--rank", "0", "--num-workers", "2"]
        out, _ = run([*worker, "--steps", str(steps), "--metrics-port", "-1", "--json", "digits"], timeout=120)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"nothing to do: the cluster is at step 10, and --steps is {steps}" in out.stderr, out.stderr[-2000:]
    return strict_json(out.stdout.strip().splitlines()[-1])


SLEEPY_RANK = """
import sys, time
argv = getattr(sys, "orig_argv", sys.argv)
if "ps_worker.workloads.cli" in argv and argv[argv.index("--rank") + 1] == "1":
    time.sleep(120)  # this rank never joins (a hung start-up)
"""


@pytest.mark.slow
def test_rank_that_never_joins_fails_the_launch_naming_it(tmp_path) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLEEPY_RANK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
    # before: rank 0 waited --timeout (60 s) per pull, retrying, while the shard said nothing
    out = launch(tmp_path / "logs", 10, "--join-timeout", "3", "--timeout", "60", timeout=120, env=env)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Ranks [1] never joined shard 0 within --join-timeout 3 s" in out.stderr, out.stderr[-3000:]
    assert "FAILED_PRECONDITION" in out.stderr
