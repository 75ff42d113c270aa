"""Two network namespaces joined by a veth pair, made and deleted by a test (root and iproute2),
and processes started inside them: multi-host tests without leaving 127.0.0.1's machine. All
traffic stays inside the namespaces; every process runs in one of them (``ip netns exec``)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


def namespaces() -> Iterator[tuple[str, str, str]]:
    """Make namespaces A and B (veth 10.231.x.1 in A, .2 in B); yields (A, B, A's address) and
    deletes them after; skips the test when they cannot be made."""
    tag = f"{os.getpid() % 100000}"
    a, b = f"gps{tag}a", f"gps{tag}b"
    net = f"10.231.{os.getpid() % 250}"
    try:
        sh("ip", "netns", "add", a)
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", f"v{tag}a", "netns", a, "type", "veth", "peer", "name", f"v{tag}b", "netns", b)
        sh("ip", "-n", a, "addr", "add", f"{net}.1/30", "dev", f"v{tag}a")
        sh("ip", "-n", b, "addr", "add", f"{net}.2/30", "dev", f"v{tag}b")
        for ns, dev in ((a, f"v{tag}a"), (b, f"v{tag}b")):
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", dev, "up")
    except subprocess.CalledProcessError as exc:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode(errors='replace').strip()}")
    yield a, b, f"{net}.1"
    for ns in (a, b):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def in_ns(ns: str, *argv: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], text=True, **kwargs)
