"""An emulated cluster network on one machine: a namespace per host behind a shaped veth link.

Topology: one "switch" namespace holding a Linux bridge; every host (a worker, a shard, a gloo
rank, ...) a namespace of its own, joined to the bridge by a veth pair whose host end carries
the address ``10.X.0.N/24`` and whose switch end is a port of the bridge. Each link is shaped in
both directions with ``tc qdisc ... tbf``: on the host end (the host's egress) and on the switch
end (the host's ingress), so a host can neither send nor receive faster than the link's rate.
``netem`` is not needed (nor available in every kernel): links add no delay beyond queueing.

Everything is created and deleted here: names carry a per-run prefix (``psb<pid>-``), the
namespaces go away in :meth:`Netlab.close`, at exit and on SIGINT/SIGTERM (deleting a namespace
deletes its veth ends; the bridge goes with the switch namespace). :func:`cleanup` deletes what a
killed run left behind. Nothing is ever configured in, or dialled from, the root namespace.

The module also holds the link check's two roles, run inside namespaces by the bench:

    python bench/netns.py sink --host ADDR          # prints {"port": P}, then {"bytes", "seconds"}
    python bench/netns.py source --to ADDR:P --bytes N
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

PREFIX = "psb"
"""Every namespace of the bench is named ``psb<pid>-<host>``; :func:`cleanup` looks for these."""
BRIDGE = "br0"
CMD_TIMEOUT = 30.0
"""Seconds one ``ip``/``tc`` command may take."""
MAX_HOSTS = 250


# ---------------------------------------------------------------------- pure planning
def parse_rate(text: str) -> int:
    """Bits per second of a tc-style rate: ``1gbit``, ``500mbit``, ``100kbit``, ``2000000bit``.

    Raises:
        ValueError: not of that form, or not positive.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)bit\s*", text.lower())
    if not m:
        raise ValueError(f"a rate looks like 1gbit, 500mbit or 100kbit, got {text!r}")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    if value <= 0:
        raise ValueError(f"a rate must be positive, got {text!r}")
    return int(value)


def tbf_burst(rate_bps: int) -> int:
    """The token bucket's depth in bytes: 4 ms of the rate (``rate / 250``, one tick at HZ=250),
    at least 64 KiB so one TSO/GSO super-packet (up to 64 KiB) always fits."""
    return max(64 * 1024, rate_bps // 8 // 250)


@dataclass(frozen=True)
class Host:
    """One emulated machine: its namespace, the two ends of its veth link, its address."""

    role: str
    ns: str
    veth_host: str
    veth_switch: str
    address: str


@dataclass(frozen=True)
class Plan:
    """Every name and address of one emulated network."""

    prefix: str
    switch_ns: str
    hosts: tuple[Host, ...]
    subnet: str

    def host(self, role: str) -> Host:
        """The host named ``role``.

        Raises:
            KeyError: no such host.
        """
        for h in self.hosts:
            if h.role == role:
                return h
        raise KeyError(role)


def plan_network(roles: Sequence[str], pid: int, subnet: int = 77) -> Plan:
    """Names and addresses of a network of ``roles`` for the run of process ``pid``.

    Host ``i`` gets namespace ``psb<pid>-<role>``, veth ends ``psb<pid>h<i>`` (in the host) and
    ``psb<pid>s<i>`` (in the switch), both at most 15 characters (the kernel's IFNAMSIZ - 1),
    and address ``10.<subnet>.0.<i + 1>``.

    Raises:
        ValueError: no roles, too many, duplicates, or a role that is not ``[a-z0-9]+``.
    """
    if not roles or len(roles) > MAX_HOSTS:
        raise ValueError(f"1..{MAX_HOSTS} hosts, got {len(roles)}")
    if len(set(roles)) != len(roles):
        raise ValueError(f"duplicate host roles in {list(roles)}")
    if not 0 <= subnet <= 255:
        raise ValueError(f"subnet must be 0..255, got {subnet}")
    for r in roles:
        if not re.fullmatch(r"[a-z0-9]{1,20}", r) or r == "switch":
            raise ValueError(f"a host role is [a-z0-9]{{1,20}} and not 'switch', got {r!r}")
    prefix = f"{PREFIX}{pid}"
    hosts = tuple(
        Host(role, f"{prefix}-{role}", f"{prefix}h{i}", f"{prefix}s{i}", f"10.{subnet}.0.{i + 1}")
        for i, role in enumerate(roles)
    )
    if any(len(h.veth_host) > 15 or len(h.veth_switch) > 15 for h in hosts):
        raise ValueError(f"interface names of pid {pid} would exceed 15 characters")
    return Plan(prefix, f"{prefix}-switch", hosts, f"10.{subnet}.0.0/24")


def leftover_namespaces(names: Sequence[str], alive: set[int]) -> list[str]:
    """The bench's namespaces among ``names`` whose run (``psb<pid>-...``) is no longer alive."""
    out = []
    for n in names:
        m = re.fullmatch(rf"{PREFIX}(\d+)-[a-z0-9]+", n)
        if m and int(m.group(1)) not in alive:
            out.append(n)
    return out


# ---------------------------------------------------------------------- root networking
def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one command (``ip``, ``tc``) with a deadline.

    Raises:
        RuntimeError: it failed (with ``check``) or ran past :data:`CMD_TIMEOUT`.
    """
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=CMD_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{' '.join(argv)}: no answer in {CMD_TIMEOUT} s") from exc
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def list_namespaces() -> list[str]:
    """Names of the network namespaces (``ip netns list``)."""
    out = sh("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def cleanup(all_runs: bool = False) -> list[str]:
    """Delete the bench's namespaces left by runs that are gone (``all_runs``: by any run, alive
    or not). Returns the names deleted. Touches no namespace without the bench's prefix."""
    names = list_namespaces()
    alive = set() if all_runs else {int(p) for p in os.listdir("/proc") if p.isdigit()}
    gone = leftover_namespaces(names, alive)
    for n in gone:
        sh("ip", "netns", "delete", n, check=False)
    return gone


class Netlab:
    """The namespaces of one :class:`Plan`, shaped at one rate; deleted by :meth:`close`.

    Args:
        plan: names and addresses (see :func:`plan_network`).
        rate_bps: the rate of every link, each direction (None: not shaped).
        mtu: of every interface (1500: Ethernet; 9000: jumbo frames).
        latency_ms: tbf's queue limit expressed as the longest wait a packet may have in it.
    """

    def __init__(self, plan: Plan, rate_bps: int | None, mtu: int = 1500, latency_ms: float = 50.0) -> None:
        self.plan = plan
        self.mtu = mtu
        self.latency_ms = latency_ms
        self.rate_bps = rate_bps
        self.created: list[str] = []
        self._old_handlers: dict[int, object] = {}

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> Netlab:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Create the switch, the hosts and their links; shape every link at ``rate_bps``. On an
        error, what was created is deleted before it is raised."""
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """SIGINT/SIGTERM become an exception, so the caller's ``finally`` stops its processes and
        then :meth:`close` runs (also registered with :mod:`atexit` as a backstop)."""
        raise SystemExit(128 + signum)

    def _add_ns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.created.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        p = self.plan
        sw = p.switch_ns
        self._add_ns(sw)
        sh("ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "-n", sw, "link", "set", BRIDGE, "mtu", str(self.mtu), "up")
        for h in p.hosts:
            self._add_ns(h.ns)
            # Both ends are created directly in their namespaces: nothing appears in the root one.
            sh(
                "ip",
                "link",
                "add",
                h.veth_host,
                "netns",
                h.ns,
                "type",
                "veth",
                "peer",
                "name",
                h.veth_switch,
                "netns",
                sw,
            )
            sh("ip", "-n", h.ns, "link", "set", h.veth_host, "mtu", str(self.mtu), "up")
            sh("ip", "-n", h.ns, "addr", "add", f"{h.address}/24", "dev", h.veth_host)
            sh("ip", "-n", sw, "link", "set", h.veth_switch, "mtu", str(self.mtu), "master", BRIDGE, "up")
        self.shape(self.rate_bps, verb="add")

    def shape(self, rate_bps: int | None, verb: str = "replace") -> None:
        """(Re)shape both directions of every link at ``rate_bps``; None removes the shaping (the
        links then run as fast as the CPU moves packets)."""
        self.rate_bps = rate_bps
        if rate_bps is None:
            for h in self.plan.hosts:
                sh("tc", "-n", h.ns, "qdisc", "del", "dev", h.veth_host, "root", check=False)
                sh("tc", "-n", self.plan.switch_ns, "qdisc", "del", "dev", h.veth_switch, "root", check=False)
            return
        tbf = ["tbf", "rate", f"{rate_bps}bit", "burst", str(tbf_burst(rate_bps)), "latency", f"{self.latency_ms}ms"]
        for h in self.plan.hosts:
            sh("tc", "-n", h.ns, "qdisc", verb, "dev", h.veth_host, "root", *tbf)
            sh("tc", "-n", self.plan.switch_ns, "qdisc", verb, "dev", h.veth_switch, "root", *tbf)

    def qdisc(self, role: str) -> str:
        """``tc -s qdisc`` of ``role``'s host end (for the record)."""
        h = self.plan.host(role)
        return sh("tc", "-n", h.ns, "-s", "qdisc", "show", "dev", h.veth_host).stdout.strip()

    def drops(self) -> dict[str, tuple[int, int]]:
        """Packets each link's tbf dropped since it was shaped: role -> (egress, ingress), read
        from ``tc -s qdisc`` of the host end and of the switch end."""

        def dropped(ns: str, dev: str) -> int:
            out = sh("tc", "-n", ns, "-s", "qdisc", "show", "dev", dev, check=False).stdout
            m = re.search(r"dropped (\d+)", out)
            return int(m.group(1)) if m else 0

        sw = self.plan.switch_ns
        return {h.role: (dropped(h.ns, h.veth_host), dropped(sw, h.veth_switch)) for h in self.plan.hosts}

    def close(self) -> None:
        """Delete every namespace this run created (idempotent)."""
        for name in reversed(self.created):
            sh("ip", "netns", "delete", name, check=False)
        self.created = []
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old_handlers = {}

    def argv(self, role: str, command: Sequence[str]) -> list[str]:
        """``command`` run inside ``role``'s namespace."""
        return ["ip", "netns", "exec", self.plan.host(role).ns, *command]

    def address(self, role: str) -> str:
        return self.plan.host(role).address


# ---------------------------------------------------------------------- link check roles
CHUNK = 1 << 20


def sink(host: str, timeout: float) -> None:
    """Accept one connection on ``host``; read until it closes; report bytes and seconds from the
    first byte to the last."""
    listener = socket.create_server((host, 0))
    listener.settimeout(timeout)
    print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
    conn, _ = listener.accept()
    conn.settimeout(timeout)
    buf = bytearray(CHUNK)
    total, first, last = 0, 0.0, 0.0
    with conn:
        for _ in range(10**8):
            n = conn.recv_into(buf)
            if n == 0:
                break
            last = time.perf_counter()
            if total == 0:
                first = last
            total += n
    print(json.dumps({"bytes": total, "seconds": last - first}), flush=True)


def source(to: str, nbytes: int, timeout: float) -> None:
    """Send ``nbytes`` to ``to`` (``ADDR:PORT``) over one TCP connection, then close it."""
    addr, port = to.rsplit(":", 1)
    with socket.create_connection((addr, int(port)), timeout=timeout) as conn:
        data = memoryview(bytearray(CHUNK))
        sent = 0
        while sent < nbytes:
            conn.sendall(data[: min(CHUNK, nbytes - sent)])
            sent += min(CHUNK, nbytes - sent)
    print(json.dumps({"sent": sent}), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("sink", help="receive one stream, report its rate")
    s.add_argument("--host", required=True)
    s.add_argument("--timeout", type=float, default=120.0)
    c = sub.add_parser("source", help="send N bytes to a sink")
    c.add_argument("--to", required=True)
    c.add_argument("--bytes", type=int, required=True)
    c.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    if args.role == "sink":
        sink(args.host, args.timeout)
    else:
        source(args.to, args.bytes, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
