"""Fault test: writers killed with SIGKILL at many instants of a checkpoint save never leave one that loads wrong.

Importing torch takes seconds here, so the writers are forked from one fork server
(``tests/helpers/checkpoint_writer.py``) that imported it once; each kill is then cheap. Every
writer is our own grandchild, killed by PID before the fork server reaps it (so the PID cannot
have been reused), and every wait has a deadline.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import TracebackType

import pytest

from ps_common.errors import CheckpointError
from ps_server.checkpoint.files import CheckpointStore
from tests.helpers.checkpoint_writer import expected_state
from tests.helpers.compare import assert_identical

ROOT = Path(__file__).resolve().parents[2]
KILLS = 60
"""Kills to make; at least MIN_KILLS, then fewer if BUDGET_S runs out."""
MIN_KILLS = 20
BUDGET_S = 35.0
MIB = 4
KEEP = 2
LINE_TIMEOUT_S = 120.0  # generous: a loaded 2-core CI machine; a healthy writer answers in well under a second
"""Deadline for any one line of a writer (a save of MIB MiB takes well under a second)."""


class WriterServer:
    """The fork server as a subprocess; lines of its writers are read by a thread into a queue."""

    def __init__(self, directory: Path, log: Path) -> None:
        self._stderr = log.open("wb")
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.checkpoint_writer", str(directory), "--keep", str(KEEP)]
            + ["--mib", str(MIB)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )
        self.lines: queue.Queue[list[str] | None] = queue.Queue()
        self.events: dict[int, list[list[str]]] = {}
        self.live: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()
        self._expect(lambda w: w == ["ready"], 120.0, "the fork server to import torch")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode().split())
        self.lines.put(None)

    def _expect(self, match: object, timeout: float, what: str) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                words = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; stderr: {self.stderr_tail()}")
            if words is None:
                pytest.fail(f"the fork server exited while waiting for {what}; stderr: {self.stderr_tail()}")
            if words[0] == "error":
                pytest.fail(f"a writer failed: {' '.join(words)}")
            if len(words) > 1 and words[0] != "spawned":
                self.events.setdefault(int(words[1]), []).append(words)
            if match(words):  # type: ignore[operator]
                return words

    def stderr_tail(self) -> str:
        self._stderr.flush()
        return self.log.read_text(errors="replace")[-2000:]

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{line}\n".encode())
        self.proc.stdin.flush()

    def spawn(self) -> int:
        self._send("spawn")
        pid = int(self._expect(lambda w: w[0] == "spawned", LINE_TIMEOUT_S, "a writer to fork")[1])
        self.live.add(pid)
        return pid

    def expect(self, pid: int, kind: str) -> list[str]:
        """The next ``kind`` line (resumed, writing, saved) of writer ``pid``."""
        return self._expect(lambda w: w[0] == kind and w[1] == str(pid), LINE_TIMEOUT_S, f"{kind} from writer {pid}")

    def kill(self, pid: int) -> list[list[str]]:
        """SIGKILL writer ``pid``, wait until it is reaped; returns every line it printed."""
        os.kill(pid, signal.SIGKILL)
        self._send(f"reap {pid}")
        reaped = self._expect(lambda w: w[0] == "reaped" and w[1] == str(pid), LINE_TIMEOUT_S, f"writer {pid} to die")
        self.live.discard(pid)
        assert reaped[2] == str(int(signal.SIGKILL)), f"writer {pid} ended otherwise than by our SIGKILL: {reaped}"
        return [w for w in self.events.pop(pid) if w[0] != "reaped"]

    def __enter__(self) -> WriterServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for pid in self.live:  # not yet reaped, so still ours
            os.kill(pid, signal.SIGKILL)
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # the fork server kills and reaps its writers and exits
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._stderr.close()


def phase(directory: Path, in_flight: int) -> str:
    """Where the kill landed in the save of version ``in_flight``, judged from the files it left."""
    temps = [p for p in directory.glob(".shard-0-*.tmp")]
    finals = sorted(directory.glob("shard-0-v*.pt"))
    if temps:
        full = finals[-1].stat().st_size if finals else None
        size = temps[0].stat().st_size
        return "temp file complete, not yet renamed" if full and size >= full - 64 else "temp file torn"
    if finals and finals[-1].name == f"shard-0-v{in_flight:012d}.pt":
        return "after the rename (directory fsync, pruning)"
    return "before the temp file (digest) or between saves"


def check_as_final(temp: Path, version: int, scratch: Path, outcomes: Counter[str]) -> None:
    """A temp file left by a kill, put under its final name (as a rename that was not atomic would),
    either fails validation or holds exactly ``expected_state(version)``: the digest, not only the
    rename, keeps a torn write from loading."""
    scratch.mkdir()
    final = CheckpointStore(scratch, 0).path_for(version)
    final.write_bytes(temp.read_bytes())
    try:
        state = CheckpointStore(scratch, 0).load(version)
    except CheckpointError:
        outcomes["fail validation"] += 1
    else:
        assert_identical(state, expected_state(version, MIB), f"temp file of v{version} under its final name")
        outcomes["load right"] += 1


def test_sigkill_at_any_instant_never_leaves_a_checkpoint_that_loads_wrong(tmp_path: Path) -> None:
    """After each kill: no exception, the newest complete checkpoint loads, holds exactly what its
    version should, is no older than the newest save that returned; the next save succeeds."""
    directory = tmp_path / "ckpt"
    rng = random.Random(20240611)
    phases: Counter[str] = Counter()
    temps: Counter[str] = Counter()
    write_s: list[float] = []
    newest_saved = loaded = kills = 0
    start = time.monotonic()
    with WriterServer(directory, tmp_path / "writers.log") as server:
        for i in range(KILLS):
            if i >= MIN_KILLS and time.monotonic() - start > BUDGET_S:
                break
            pid = server.spawn()
            resumed = int(server.expect(pid, "resumed")[2])
            assert resumed == loaded, "a restarted writer resumes from what load_latest() returned"
            for _ in range(rng.choice((1, 1, 2, 3)) - 1):
                server.expect(pid, "saved")  # its first saves after a kill must succeed
            server.expect(pid, "writing")
            typical = statistics.median(write_s) if write_s else 0.05
            time.sleep((i + rng.random()) / KILLS * 1.3 * typical)  # spread over the save and just past it
            events = server.kill(pid)
            kills += 1

            write_s += [float(w[3]) for w in events if w[0] == "saved"]
            newest_saved = max([newest_saved] + [int(w[2]) for w in events if w[0] == "saved"])
            in_flight = max(int(w[2]) for w in events if w[0] == "writing")
            phases[phase(directory, in_flight)] += 1
            for temp in directory.glob(".shard-0-*.tmp"):
                check_as_final(temp, in_flight, tmp_path / f"renamed-{i}", temps)

            store = CheckpointStore(directory, 0, keep=KEEP)
            assert not list(directory.glob(".*.tmp")), "opening the store removes torn temp files"
            assert len(store.checkpoints()) <= KEEP + 1
            latest = store.load_latest()
            if newest_saved == 0 and latest is None:
                continue
            assert latest is not None
            version, state = latest
            assert newest_saved <= version <= in_flight, (newest_saved, version, in_flight)
            assert_identical(state, expected_state(version, MIB), f"checkpoint v{version} after kill {i}")
            loaded = version

    store = CheckpointStore(directory, 0, keep=KEEP)
    store.save(expected_state(loaded + 1, MIB), loaded + 1)
    version, state = store.load_latest()
    assert version == loaded + 1
    assert_identical(state, expected_state(version, MIB))

    summary = "; ".join(f"{n} {name}" for name, n in phases.most_common())
    summary += "; temp files under their final name: " + ", ".join(f"{n} {name}" for name, n in temps.items())
    took = time.monotonic() - start
    print(f"\n{kills} kills in {took:.1f} s, a save takes {statistics.median(write_s) * 1e3:.0f} ms: {summary}")
    inside = phases["temp file torn"] + phases["temp file complete, not yet renamed"]
    assert inside >= kills // 4, f"too few kills landed inside a write to test anything: {summary}"
