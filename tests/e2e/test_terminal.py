"""ps-launch and ps-worker in a real terminal (tmux, 100x40): the progress lines show while training
runs, and the summary comes out intact after the bars close."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from ps_server.config import ServerConfig
from ps_server.server import start_server
from tests.integration.conftest import find_tool

WIDTH, HEIGHT = 100, 40


class Terminal:
    """One tmux session of WIDTH x HEIGHT on a private socket."""

    def __init__(self) -> None:
        self.tmux = find_tool("tmux")
        self.base = [self.tmux, "-L", f"ps-term-{uuid.uuid4().hex[:8]}", "-f", "/dev/null"]
        self.session = f"ps-{uuid.uuid4().hex[:8]}"
        self.tm("new-session", "-d", "-s", self.session, "-x", str(WIDTH), "-y", str(HEIGHT))
        self.tm("set-option", "-t", self.session, "status", "off")
        self.tm("set-option", "-t", self.session, "history-limit", "5000")

    def tm(self, *args: str) -> str:
        return subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=10, check=True).stdout

    def run(self, argv: list[str]) -> None:
        self.tm("send-keys", "-t", self.session, f"clear; {shlex.join(argv)}; echo __exit=$?", "Enter")

    def screen(self) -> str:
        """The pane and its scrollback, as a person would read it (wrapped lines joined)."""
        return self.tm("capture-pane", "-p", "-J", "-S", "-", "-t", self.session)

    def wait(self, pattern: str, timeout: float, interval: float = 0.2) -> str:
        stop = time.monotonic() + timeout
        while time.monotonic() < stop:
            text = self.screen()
            if re.search(pattern, text, re.MULTILINE):
                return text
            time.sleep(interval)
        pytest.fail(f"timed out after {timeout:.0f} s waiting for {pattern!r} in:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def terminal() -> Iterator[Terminal]:
    t = Terminal()
    yield t
    t.close()


def summary_block(screen: str, header: str) -> list[str]:
    """The lines from ``header`` (which must start a line of its own) to the exit marker."""
    lines = [line.rstrip() for line in screen.splitlines()]
    assert header in lines, f"{header!r} is not a line of its own:\n{screen}"
    start = lines.index(header)
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("__exit="))
    return lines[start:end]


@pytest.mark.slow
def test_ps_launch_in_a_terminal_shows_progress_then_an_intact_summary(terminal) -> None:
    argv = [sys.executable, "-m", "ps_launch.cli", "--shards", "1", "--workers", "2", "--steps", "300"]
    terminal.run([*argv, "--slow-rank", "0", "--slow-ms", "15", "--no-metrics", "digits"])
    terminal.wait(r"^ps-launch: started worker-1", 240, interval=0.05)
    spawned = time.monotonic()
    bar = r"^rank [01]:\s+\d+%.*\b([1-9]\d{2}|[6-9]\d)/300 \[(\d+):(\d\d)<.*step/s.*loss=\d\.\d{4}"
    during = terminal.wait(bar, 240)
    since_spawn = time.monotonic() - spawned
    minutes, seconds = re.search(bar, during, re.MULTILINE).groups()[1:]
    # the bar's clock (and so its rate) starts at the rank's first step: the worker's start-up (a Python
    # process importing torch, loading data, joining) is not in it
    assert int(minutes) * 60 + int(seconds) < since_spawn - 1.5, (since_spawn, during)
    final = terminal.wait(r"^__exit=\d+", 240)
    assert "__exit=0" in final, final
    block = summary_block(final, "grpc-ps run summary")
    keys = [line[2:].split("  ")[0] for line in block[1:]]
    assert keys[:4] == ["workload", "steps per worker", "steps run per rank", "final loss"], block
    assert all(line.startswith("  ") and len(line) <= WIDTH for line in block[1:]), block
    assert not any("rank 0:" in line or "rank 1:" in line for line in block), block  # no bar left inside


@pytest.mark.slow
def test_ps_worker_in_a_terminal_shows_progress_then_its_summary(terminal) -> None:
    shard = start_server(ServerConfig(shard_index=0, num_shards=1, num_workers=1, port=0))
    try:
        argv = [sys.executable, "-m", "ps_worker.workloads.cli", "--servers", f"127.0.0.1:{shard.port}", "--rank", "0"]
        terminal.run([*argv, "--num-workers", "1", "--steps", "300", "--slow-rank", "0", "--slow-ms", "15", "digits"])
        terminal.wait(r"^rank 0:\s+\d+%.*\d+/300 .*step/s.*loss=\d\.\d{4}", 240)
        final = terminal.wait(r"^__exit=\d+", 240)
    finally:
        shard.stop(grace=0.5)
    assert "__exit=0" in final, final
    block = summary_block(final, "ps-worker rank 0 summary")
    assert [line[2:].split("  ")[0] for line in block[1:3]] == ["workload", "steps"], block
    assert not any("rank 0:" in line for line in block), block
