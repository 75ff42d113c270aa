"""grpc-ps against all-reduce and the rpc PS on an emulated cluster network (needs root).

    python bench/emulated.py --rate 1gbit,5gbit --mb 25 [--rounds 3] [--json out.json]
    python bench/emulated.py --cleanup          # delete namespaces a killed run left behind

Every worker, shard, gloo rank and rpc process runs in a network namespace of its own ("a host"),
joined to a bridge in a "switch" namespace by a veth link shaped in both directions with
``tc qdisc ... tbf`` at ``--rate`` (see ``netns.py``). Hosts: ``w0..w3`` (grpc-ps workers, gloo
ranks, rpc workers) and ``s0..s3`` (grpc-ps shards; ``s0`` also holds the rpc PS). Every system runs
on the same links, in rounds alternating A B C ... A B C ..., per rate; the namespaces are made
and deleted by this run (also on SIGINT/SIGTERM). The controller talks to its children over their
stdin/stdout only: no traffic is sent from, or to, the root namespace.

Each system's median step is set against its bytes-on-the-wire time: the bytes the busiest link
carries in its busiest direction, over the rate. A sync PS step of W workers and S shards with N
bytes of parameters (N/2 on a bf16 wire) moves N each way on a worker link and W*N/S each way on
a shard link; a ring all-reduce of k ranks moves 2N(k-1)/k each way on every link (BytePS, Jiang et
al., OSDI 2020); the rpc PS is one shard: W*N on its link. See EMULATED.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _common import (
    BENCH,
    Child,
    ChildError,
    ask_all,
    busy_fraction,
    child_env,
    cpu_seconds,
    machine_ticks,
    shard_argv,
    stop_all,
)
from netns import Netlab, cleanup, parse_rate, plan_network

PY = sys.executable
STARTUP_TIMEOUT = 300.0
SETUP_TIMEOUT = 300.0
STEP_TIMEOUT = 60.0
CORES = os.cpu_count() or 1
"""CPUs of the machine every emulated host shares: a step needs at least its CPU seconds over this."""
GLOO_PORT, RPC_PORT = 29500, 29600
"""Ports in the hosts' own namespaces, all free there (nothing else runs in them)."""
WIRE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---------------------------------------------------------------------- formulas (pure)
def ps_link_bytes(nbytes: int, workers: int, shards: int, wire_itemsize: int = 4) -> int:
    """Bytes the busiest link of a sync PS step carries each way: a worker link N (its gradient up,
    the weights down), a shard link W*N/S; N in the wire dtype (``nbytes`` is float32)."""
    n = nbytes * wire_itemsize // 4
    return max(n, workers * n // shards)


def ring_link_bytes(nbytes: int, ranks: int) -> int:
    """Bytes each link of a ring all-reduce of ``ranks`` carries each way: 2N(k-1)/k."""
    return 2 * nbytes * (ranks - 1) // ranks


def wire_seconds(link_bytes: int, rate_bps: int) -> float:
    """The time ``link_bytes`` take at ``rate_bps``."""
    return link_bytes * 8 / rate_bps


def min_shards_to_beat_ring(workers: int, wire_itemsize: int = 4, ring_itemsize: int = 4) -> float:
    """The shard count S from which a PS step's busiest link carries no more bytes than a ring
    all-reduce among the workers: the shard link needs W/S f_ps <= 2(W-1)/W f_ring, i.e.
    S >= W^2 f_ps / (2(W-1) f_ring), and the worker link N f_ps must not exceed the ring's
    (``inf`` when it does). ``f`` is the wire's bytes per float32 byte (bf16: 1/2)."""
    ps, ring = wire_itemsize / 4, ring_itemsize / 4
    if workers < 2 or ps > 2 * (workers - 1) / workers * ring:
        return float("inf")
    return workers * workers * ps / (2 * (workers - 1) * ring)


# ---------------------------------------------------------------------- systems
@dataclass
class System:
    """One measured configuration: its processes (children started in their hosts' namespaces)."""

    key: str
    family: str
    workers: int
    shards: int = 0
    wire: str = "float32"
    drivers: list[Child] = field(default_factory=list)
    passive: list[Child] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)

    @property
    def children(self) -> list[Child]:
        return [*self.passive, *self.drivers]

    def link_bytes(self, nbytes: int) -> int:
        """Bytes the busiest link carries each way in one step."""
        if self.family == "gloo":
            return ring_link_bytes(nbytes, self.workers)
        if self.family == "rpc":
            return ps_link_bytes(nbytes, self.workers, 1)
        return ps_link_bytes(nbytes, self.workers, self.shards, WIRE_BYTES[self.wire])

    def serial_bytes(self, nbytes: int) -> int:
        """Bytes the busiest link carries in one direction, then the other, when a step's pull starts
        only once its push is in: a PS that answers a round after the whole push (grpc-ps PushPull
        today, the rpc PS) uses each link one way at a time, twice :meth:`link_bytes` in time; a ring
        keeps both directions busy at once."""
        return self.link_bytes(nbytes) * (1 if self.family == "gloo" else 2)


def plan_systems(
    workers: int, shards: Sequence[int], wires: Sequence[str], gloo_ranks: Sequence[int], families: Sequence[str]
) -> list[System]:
    """The systems of one run, in the order of a round."""
    out: list[System] = []
    if "grpc-ps" in families:
        for wire in wires:
            suffix = "" if wire == "float32" else f" {'bf16' if wire == 'bfloat16' else 'fp16'}"
            out += [System(f"grpc-ps {workers}w×{s}s{suffix}", "grpc-ps", workers, s, wire) for s in shards]
    if "gloo" in families:
        out += [System(f"gloo all_reduce {k} ranks", "gloo", k) for k in gloo_ranks]
    if "rpc" in families:
        out.append(System(f"rpc PS {workers}w", "rpc", workers, 1))
    return out


class Bench:
    """Starts the systems' processes in the lab's hosts and runs their steps."""

    def __init__(self, lab: Netlab, args: argparse.Namespace, log_dir: Path) -> None:
        self.lab, self.args, self.log_dir = lab, args, log_dir
        self.base_env = child_env(args.threads)

    def env(self, role: str) -> dict[str, str]:
        """The child environment, with gloo and TensorPipe bound to ``role``'s veth."""
        ifname = self.lab.plan.host(role).veth_host
        return {**self.base_env, "GLOO_SOCKET_IFNAME": ifname, "TP_SOCKET_IFNAME": ifname}

    def child(self, name: str, role: str, command: Sequence[str]) -> Child:
        return Child(name, self.lab.argv(role, command), self.env(role), self.log_dir)

    def start(self, s: System, index: int) -> None:
        """Start ``s``'s processes (grpc-ps shards bind their host's address)."""
        tag = s.key.replace(" ", "").replace("×", "x")
        if s.family == "grpc-ps":
            for k in range(s.shards):
                argv = [*shard_argv(k, s.shards, s.workers), "--host", self.lab.address(f"s{k}"), "--insecure"]
                s.passive.append(self.child(f"{tag}-shard{k}", f"s{k}", argv))
            for r in range(s.workers):
                argv = [PY, str(BENCH / "grpc_ps.py"), "--rank", str(r), "--workers", str(s.workers)]
                s.drivers.append(self.child(f"{tag}-worker{r}", f"w{r}", argv))
        elif s.family == "gloo":
            port, master = str(GLOO_PORT + index), self.lab.address("w0")
            for r in range(s.workers):
                argv = [PY, str(BENCH / "gloo_allreduce.py"), "--rank", str(r), "--world-size", str(s.workers)]
                argv += ["--port", port, "--master-addr", master]
                s.drivers.append(self.child(f"{tag}-{r}", f"w{r}", argv))
        else:
            port, host = str(RPC_PORT + index), self.lab.address("s0")
            common = ["--workers", str(s.workers), "--port", port, "--host", host]
            s.passive.append(self.child(f"{tag}-ps", "s0", [PY, str(BENCH / "rpc_ps.py"), "--rank", "0", *common]))
            for r in range(1, s.workers + 1):
                argv = [PY, str(BENCH / "rpc_ps.py"), "--rank", str(r), *common]
                s.drivers.append(self.child(f"{tag}-worker{r}", f"w{r - 1}", argv))

    def ready(self, s: System, deadline: float) -> None:
        """Wait for ``s``'s processes to be up, then set it up for the payload."""
        if s.family == "grpc-ps":
            s.addresses = [
                c.wait_for(r"listening on (\S+)", max(0.01, deadline - time.monotonic())).group(1) for c in s.passive
            ]
            for c in s.drivers:
                c.recv(max(0.01, deadline - time.monotonic()), "start-up")
            ask_all(
                s.drivers,
                "setup",
                SETUP_TIMEOUT,
                servers=s.addresses,
                bytes=self.args.nbytes,
                partition_bytes=self.args.partition_bytes,
                wire_dtype=s.wire,
            )
        else:
            for c in s.children:
                c.recv(max(0.01, deadline - time.monotonic()), "start-up")
            ask_all(s.children, "setup", SETUP_TIMEOUT, bytes=self.args.nbytes)

    def run(self, s: System) -> tuple[list[list[float]], float, float]:
        """One round of ``s``: each driver's step seconds, CPU seconds of all its processes per
        step, and the fraction of the whole machine's CPU time that was busy meanwhile."""
        a = self.args
        pids = [c.proc.pid for c in s.children]
        before = sum(cpu_seconds(p) for p in pids)
        ticks = machine_ticks()
        answers = ask_all(s.drivers, "run", (a.warmup + a.iters) * STEP_TIMEOUT + 30, iters=a.iters, warmup=a.warmup)
        busy = busy_fraction(ticks, machine_ticks())
        cpu = sum(cpu_seconds(p) for p in pids) - before
        return [next(iter(r["samples"].values())) for r in answers], cpu / (a.warmup + a.iters), busy


def link_check(lab: Netlab, log_dir: Path, seconds: float = 1.0) -> dict[str, float]:
    """One TCP stream w0 -> w1 for about ``seconds`` at the link rate: its goodput, Gbit/s."""
    rate = lab.rate_bps or 10 * 10**9
    nbytes = int(rate / 8 * seconds)
    env = child_env(1)
    sink = Child(
        "linkcheck-sink",
        lab.argv("w1", [PY, str(BENCH / "netns.py"), "sink", "--host", lab.address("w1")]),
        env,
        log_dir,
    )
    try:
        port = sink.recv(60, "link check")["port"]
        src_argv = [
            PY,
            str(BENCH / "netns.py"),
            "source",
            "--to",
            f"{lab.address('w1')}:{port}",
            "--bytes",
            str(nbytes),
        ]
        source = Child("linkcheck-source", lab.argv("w0", src_argv), env, log_dir)
        try:
            got = sink.recv(120, "link check")
            source.recv(30, "link check")
        finally:
            source.stop(grace=5.0)
    finally:
        sink.stop(grace=5.0)
    return {"bytes": got["bytes"], "seconds": got["seconds"], "gbit_s": got["bytes"] * 8 / got["seconds"] / 1e9}


# ---------------------------------------------------------------------- the run
def measure(args: argparse.Namespace, log_dir: Path) -> dict[str, object]:
    """Build the network, start every system, then per rate: shape, check the link, run the rounds."""
    systems = plan_systems(args.workers, args.shards, args.wire_dtypes, args.gloo_ranks, args.systems)
    n_w = max([args.workers, *(s.workers for s in systems if s.family == "gloo")])
    n_s = max([0, *(s.shards for s in systems)])  # grpc-ps shards; the rpc PS is on s0
    roles = [f"w{i}" for i in range(n_w)] + [f"s{i}" for i in range(n_s)]
    plan = plan_network(roles, os.getpid(), args.subnet)
    out: dict[str, object] = {
        "load_start": os.getloadavg(),
        "rates": {},
        "hosts": {h.role: h.address for h in plan.hosts},
    }
    with Netlab(plan, args.rates[0], mtu=args.mtu, latency_ms=args.latency_ms) as lab:
        print(f"emulated: {len(plan.hosts)} hosts + switch, namespaces {plan.prefix}-*, MTU {args.mtu}", flush=True)
        bench = Bench(lab, args, log_dir)
        try:
            started = time.monotonic()
            for i, s in enumerate(systems):
                bench.start(s, i)
            deadline = time.monotonic() + STARTUP_TIMEOUT
            for s in systems:
                bench.ready(s, deadline)
            print(
                f"emulated: {len(systems)} systems up in {time.monotonic() - started:.0f} s; logs in {log_dir}",
                flush=True,
            )
            for rate_text, rate in zip(args.rate_texts, args.rates, strict=True):
                lab.shape(rate)
                check = link_check(lab, log_dir)
                print(f"emulated: rate {rate_text}: link check w0->w1 {check['gbit_s']:.3f} Gbit/s", flush=True)
                load0 = os.getloadavg()
                series: dict[str, dict[str, object]] = {
                    s.key: {"samples": [], "all_ranks": [], "cpu_per_step": [], "machine_busy": []} for s in systems
                }
                for rnd in range(args.rounds):
                    for s in systems:
                        per_rank, cpu, busy = bench.run(s)
                        rec = series[s.key]
                        rec["machine_busy"].append(busy)  # type: ignore[attr-defined]
                        rec["samples"] += per_rank[0]  # type: ignore[operator]
                        rec["all_ranks"].append(per_rank)  # type: ignore[attr-defined]
                        rec["cpu_per_step"].append(cpu)  # type: ignore[attr-defined]
                    print(f"emulated: {rate_text} round {rnd + 1}/{args.rounds} done", flush=True)
                for s in systems:
                    rec = series[s.key]
                    rec.update(family=s.family, workers=s.workers, shards=s.shards, wire=s.wire)
                    rec["link_bytes"] = s.link_bytes(args.nbytes)
                    rec["formula_s"] = wire_seconds(s.link_bytes(args.nbytes), rate) if rate else None
                    rec["serial_s"] = wire_seconds(s.serial_bytes(args.nbytes), rate) if rate else None
                    rec["median_s"] = statistics.median(rec["samples"])  # type: ignore[arg-type]
                out["rates"][rate_text] = {  # type: ignore[index]
                    "rate_bps": rate,
                    "link_check": check,
                    "load_start": load0,
                    "load_end": os.getloadavg(),
                    "systems": series,
                    "qdisc_w0": lab.qdisc("w0") if rate else "",
                    "tbf_drops": lab.drops() if rate else {},
                }
        finally:
            stop_all([c for s in systems for c in s.children])
    out["load_end"] = os.getloadavg()
    return out


def report(result: dict[str, object], args: argparse.Namespace) -> str:
    """The tables: per rate, every system's median step against its bytes-on-the-wire time."""
    lines = [
        f"payload N = {args.nbytes / 1e6:g} MB float32; {args.iters} timed steps (+{args.warmup} warm-up) "
        f"x {args.rounds} rounds per system and rate; load average at start {fmt_load(result['load_start'])}, "
        f"at end {fmt_load(result['load_end'])}"
    ]
    for rate_text, r in result["rates"].items():  # type: ignore[attr-defined]
        rate = r["rate_bps"]
        systems = r["systems"]
        ref = reference(systems, args.workers)
        lines += [
            "",
            f"rate {rate_text} per link each way (link check: one TCP stream {r['link_check']['gbit_s']:.3f} Gbit/s); "
            f"load {fmt_load(r['load_start'])} -> {fmt_load(r['load_end'])}",
            "| system | busiest link, MB each way | wire time, ms | push-then-pull time, ms | median step, ms "
            f"| min-max, ms | measured / wire | measured / push-then-pull | CPU s per step | CPU floor, ms "
            f"| machine busy | {ref or 'gloo'} / this |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        gloo = systems[ref]["median_s"] if ref else None
        for key, v in systems.items():
            med, samples = v["median_s"], v["samples"]
            cpu = statistics.median(v["cpu_per_step"])
            formula, serial = v["formula_s"], v["serial_s"]
            wire = f"{formula * 1e3:.0f} | {serial * 1e3:.0f}" if formula else "- | -"
            ratio = f"{med / formula:.2f} | {med / serial:.2f}" if formula else "- | -"
            vs = f"{gloo / med:.2f}x" if gloo else "-"
            lines.append(
                f"| {key} | {v['link_bytes'] / 1e6:.1f} | {wire} | {med * 1e3:.0f} | "
                f"{min(samples) * 1e3:.0f}-{max(samples) * 1e3:.0f} | {ratio} | "
                f"{cpu:.2f} | {cpu / CORES * 1e3:.0f} | {statistics.median(v['machine_busy']):.0%} | {vs} |"
            )
        if rate:
            lines.append(crossover(systems, ref))
            drops = r["tbf_drops"]
            lines.append(
                "tbf drops (egress/ingress packets, all systems this rate): "
                + ", ".join(f"{role} {e}/{i}" for role, (e, i) in drops.items())
            )
    lines += [
        "",
        "CPU floor = CPU s per step / the machine's CPUs: the step time if every CPU worked on the step",
        "all the time (all hosts share them). machine busy = the share of all CPUs' time that was busy",
        "during the system's steps (/proc/stat: all but idle and iowait; also kernel network work no process",
        "is charged for). A row near its CPU floor, or with the machine near 100% busy, is bound by this",
        "machine's CPUs, not by its links.",
    ]
    return "\n".join(lines)


def reference(systems: dict[str, dict[str, object]], workers: int) -> str | None:
    """The all-reduce grpc-ps is compared with: gloo among as many ranks as grpc-ps has workers
    (else the first gloo measured)."""
    gloo = [k for k, v in systems.items() if v["family"] == "gloo"]
    same = [k for k in gloo if systems[k]["workers"] == workers]
    found = same or gloo
    return found[0] if found else None


def crossover(systems: dict[str, dict[str, object]], ref: str | None) -> str:
    """Which grpc-ps configurations beat the reference all-reduce (float32) at this rate."""
    if ref is None:
        return ""
    best = systems[ref]["median_s"]
    faster = [k for k, v in systems.items() if v["family"] == "grpc-ps" and v["median_s"] < best]  # type: ignore[operator]
    return f"grpc-ps faster than {ref} (float32): " + (", ".join(faster) or "none")


def fmt_load(load: object) -> str:
    return " ".join(f"{x:.2f}" for x in load)  # type: ignore[attr-defined]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="1gbit,5gbit", help="link rates, comma-separated (tc style; 'none': unshaped)")
    p.add_argument("--mb", type=float, default=25.0, help="payload, MB of float32 parameters")
    p.add_argument("--rounds", type=int, default=3, help="rounds per rate (every system once per round)")
    p.add_argument("--iters", type=int, default=4, help="timed steps per system and round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--workers", type=int, default=2, help="grpc-ps and rpc PS workers")
    p.add_argument("--shards", default="1,2,4", help="grpc-ps shard counts, comma-separated")
    p.add_argument("--gloo-ranks", default="2,4", help="gloo all_reduce world sizes, comma-separated")
    p.add_argument("--wire-dtypes", default="float32,bfloat16", help="grpc-ps wire dtypes")
    p.add_argument("--systems", default="grpc-ps,gloo,rpc", help="comma-separated subset of grpc-ps, gloo, rpc")
    p.add_argument(
        "--partition-bytes",
        type=int,
        default=1 << 20,
        help="grpc-ps partition_bytes (1 MiB: a streamed round pipelines per partition; 4 MiB, the library's "
        "default, leaves a 4 MiB tail on each link)",
    )
    p.add_argument("--mtu", type=int, default=1500, help="MTU of every link (9000: jumbo frames)")
    p.add_argument("--latency-ms", type=float, default=50.0, help="tbf latency (its queue's length, in time)")
    p.add_argument("--subnet", type=int, default=77, help="hosts are 10.SUBNET.0.N/24")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of every process")
    p.add_argument("--json", default="", help="write every sample here")
    p.add_argument("--log-dir", default="", help="children's logs (default: a temporary directory)")
    p.add_argument("--cleanup", action="store_true", help="delete namespaces left by runs that are gone, then exit")
    args = p.parse_args(argv)
    try:
        args.rate_texts = args.rate.split(",")
        args.rates = [None if r == "none" else parse_rate(r) for r in args.rate_texts]
        args.shards = [int(x) for x in args.shards.split(",")]
        args.gloo_ranks = [int(x) for x in args.gloo_ranks.split(",")]
    except ValueError as exc:
        p.error(str(exc))
    args.wire_dtypes = args.wire_dtypes.split(",")
    args.systems = args.systems.split(",")
    if not set(args.wire_dtypes) <= set(WIRE_BYTES):
        p.error(f"--wire-dtypes takes some of {', '.join(WIRE_BYTES)}")
    if not set(args.systems) <= {"grpc-ps", "gloo", "rpc"}:
        p.error("--systems takes some of grpc-ps, gloo, rpc")
    if not 1 <= args.rounds <= 100 or not 1 <= args.iters <= 1000 or not 0 <= args.warmup <= 100:
        p.error("--rounds 1..100, --iters 1..1000, --warmup 0..100")
    if (
        not 1 <= args.workers <= 4
        or any(not 1 <= s <= 8 for s in args.shards)
        or any(not 2 <= k <= 8 for k in args.gloo_ranks)
    ):
        p.error("--workers 1..4, --shards 1..8, --gloo-ranks 2..8")
    if not 576 <= args.mtu <= 65000:
        p.error("--mtu 576..65000")
    args.nbytes = int(args.mb * 1e6) // 4 * 4
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("emulated: needs root (ip netns, tc)", file=sys.stderr)
        return 2
    if args.cleanup:
        gone = cleanup()
        print(f"emulated: deleted {len(gone)} leftover namespaces {' '.join(gone)}")
        return 0
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="grpc-ps-emulated-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"emulated: load average {fmt_load(os.getloadavg())}; {os.cpu_count()} CPUs", flush=True)
    try:
        result = measure(args, log_dir)
    except (ChildError, RuntimeError, KeyboardInterrupt, SystemExit) as exc:
        print(f"emulated: {exc}\nlogs in {log_dir}", file=sys.stderr)
        return 1
    print(report(result, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, **result}, indent=1))
        print(f"emulated: wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
