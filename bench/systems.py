"""The measured systems of ``run.py``: each a set of child processes, started once, set up per size, asked to run steps.

``systems_for`` names the systems measured at a size, ``build`` makes one (``_common.stop_all`` stops their children).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from _common import ROOT, Child, ask_all, cpu_seconds, free_port, shard_argv, stop_all

PY = sys.executable
STARTUP_TIMEOUT = 300.0
SETUP_TIMEOUT = 300.0
STEP_TIMEOUT = 60.0
"""Seconds one timed step may take before the run is declared hung."""


@dataclass(frozen=True)
class Size:
    """A payload: ``nbytes`` of float32 (``model="digits"``: the digits MLP for grpc-ps)."""

    label: str
    nbytes: int
    warmup: int
    iters: int
    model: str = "flat"


FAMILIES = ("memcpy", "tcp", "echo", "gloo", "rpc", "grpc-ps", "native")
GRID = ((1, 1), (1, 2), (2, 1), (2, 2))
"""grpc-ps (workers, shards) measured at each size of a flat model."""


class System:
    """A measured configuration: its processes, set up per size, asked to run steps.

    ``drivers`` time the steps (the first one's samples make the table; all are kept in the JSON);
    ``passive`` members only serve.
    """

    family = ""
    memory_factor = 4
    """Peak memory a process of this system adds per payload byte, beyond
    :data:`~_common.PROCESS_BASE_BYTES` (its buffers, copies and the allocator's slack; the malloc
    tunables keep freed memory in the process). Measured at 100 MB (session 11): grpc-ps shards
    and workers 3.2–3.8, the rpc PS's processes 7–11; rounded up."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.drivers: list[Child] = []
        self.passive: list[Child] = []

    @property
    def children(self) -> list[Child]:
        return [*self.passive, *self.drivers]

    def spawn(
        self, name: str, script: str, *args: str, env: dict[str, str], log_dir: Path, driver: bool, root: Path = ROOT
    ) -> Child:
        """Start ``root``'s ``bench/SCRIPT`` (``root``: this repository, or the checkout of ``--before``)."""
        child = Child(name, [PY, str(root / "bench" / script), *args], env, log_dir, cwd=root)
        (self.drivers if driver else self.passive).append(child)
        return child

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        raise NotImplementedError

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for c in self.children:
            c.recv(max(0.01, deadline - time.monotonic()), "start-up")

    def prepare(self, size: Size) -> None:
        """Start what ``setup`` will need at ``size`` (called for every system before any setup)."""

    def setup(self, size: Size) -> None:
        ask_all(self.children, "setup", SETUP_TIMEOUT, bytes=size.nbytes)

    def sides(self) -> dict[str, list[Child]]:
        """The processes whose CPU time is also given apart (none; grpc-ps: its workers and its shards)."""
        return {}

    def run(self, size: Size) -> tuple[list[dict[str, list[float]]], dict[str, float]]:
        """One round: each driver's ``{series: [seconds, ...]}``, and the CPU seconds per step (warm-up
        included; user + system, all threads) of all this system's processes (``"all"``) and of
        each of its :meth:`sides`."""
        timeout = (size.warmup + size.iters) * STEP_TIMEOUT + 30
        groups = {"all": self.children, **self.sides()}
        before = {g: sum(cpu_seconds(c.proc.pid) for c in cs) for g, cs in groups.items()}
        answers = ask_all(self.drivers, "run", timeout, iters=size.iters, warmup=size.warmup)
        after = {g: sum(cpu_seconds(c.proc.pid) for c in cs) for g, cs in groups.items()}
        steps = (size.warmup + size.iters) * len(answers[0]["samples"])
        return [r["samples"] for r in answers], {g: (after[g] - before[g]) / steps for g in groups}

    def finish(self, size: Size) -> None:
        """Release what ``setup`` built (between sizes)."""

    def processes_to_prepare(self) -> int:
        """How many processes :meth:`prepare` starts (shards started per size)."""
        return 0

    def memory_need(self, size: Size) -> int:
        """Bytes this system's processes may add at ``size``, set up and stepped (an upper estimate)."""
        return len(self.children) * self.memory_factor * size.nbytes


class Memcpy(System):
    family = "memcpy"

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        self.spawn("memcpy", "floor.py", "memcpy", env=env, log_dir=log_dir, driver=True)


class Tcp(System):
    family = "tcp"

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        self.server = self.spawn("tcp-server", "floor.py", "tcp-server", env=env, log_dir=log_dir, driver=False)
        self.env, self.log_dir = env, log_dir

    def wait_ready(self, timeout: float) -> None:
        port = self.server.recv(timeout, "start-up")["port"]
        client = self.spawn(
            "tcp-client", "floor.py", "tcp-client", "--port", str(port), env=self.env, log_dir=self.log_dir, driver=True
        )
        client.recv(timeout, "start-up")

    def setup(self, size: Size) -> None:
        ask_all(self.drivers, "setup", SETUP_TIMEOUT, bytes=size.nbytes)


class Echo(System):
    """The transport's floor: a minimal grpcio echo (``grpc_echo.py``) of the payload in messages of
    grpc-ps's partition size. A server process, then a client that dials the port it reports."""

    family = "echo"
    script, server_role, client_role = "grpc_echo.py", "server", "client"
    setup_server = False
    """Whether the server is set up per size too (the native shard allocates its parameters)."""

    def __init__(self, key: str, partition_bytes: int) -> None:
        super().__init__(key)
        self.partition_bytes = partition_bytes

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        name = f"{self.family}-{self.server_role}"
        self.server = self.spawn(name, self.script, self.server_role, env=env, log_dir=log_dir, driver=False)
        self.env, self.log_dir = env, log_dir

    def wait_ready(self, timeout: float) -> None:
        port = self.server.recv(timeout, "start-up")["port"]
        argv = (self.client_role, "--port", str(port))
        name = f"{self.family}-{self.client_role}"
        client = self.spawn(name, self.script, *argv, env=self.env, log_dir=self.log_dir, driver=True)
        client.recv(timeout, "start-up")

    def setup(self, size: Size) -> None:
        members = self.children if self.setup_server else self.drivers
        ask_all(members, "setup", SETUP_TIMEOUT, bytes=size.nbytes, partition_bytes=self.partition_bytes)


class Native(Echo):
    """The prototype of a native data path (``native_ps.py``): one worker, one shard, raw TCP, no
    user-space copy, the optimizer step pipelined per partition."""

    family = "native"
    script, server_role, client_role = "native_ps.py", "shard", "worker"
    setup_server = True


class Gloo(System):
    family = "gloo"

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        port = str(free_port())
        for r in range(2):
            args = ("--rank", str(r), "--world-size", "2", "--port", port)
            self.spawn(f"gloo-{r}", "gloo_allreduce.py", *args, env=env, log_dir=log_dir, driver=True)


class RpcPS(System):
    family = "rpc"
    memory_factor = 12

    def __init__(self, key: str, workers: int) -> None:
        super().__init__(key)
        self.workers = workers

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        port = str(free_port())
        common = ("--workers", str(self.workers), "--port", port)
        self.spawn(f"rpc{self.workers}-ps", "rpc_ps.py", "--rank", "0", *common, env=env, log_dir=log_dir, driver=False)
        for r in range(1, self.workers + 1):
            name = f"rpc{self.workers}-worker{r}"
            self.spawn(name, "rpc_ps.py", "--rank", str(r), *common, env=env, log_dir=log_dir, driver=True)


class GrpcPS(System):
    """Worker drivers live for the whole run; shard processes (``python -m ps_server.cli``) are
    started per size, since a shard's plan is fixed at Init."""

    family = "grpc-ps"

    def __init__(
        self,
        key: str,
        workers: int,
        shards: int,
        partition_bytes: int,
        wire_dtype: str = "float32",
        plain: bool = False,
        data_path: str = "tcp",
        tree: Path | None = None,
    ) -> None:
        super().__init__(key)
        self.tree = tree or ROOT
        """The source its processes run: this repository, or another checkout (``run.py --before``)."""
        self.workers, self.shards, self.partition_bytes = workers, shards, partition_bytes
        self.wire_dtype = wire_dtype
        self.data_path = data_path
        """The workers' ``data_path``: ``tcp`` (the default: data connections), ``grpc`` (gRPC alone)."""
        self.plain = plain
        """Started as a user starts them: ``ps-server`` and a worker with no ``GLIBC_TUNABLES`` in
        their environment (each entry point sets up what it needs itself)."""
        self.shard_procs: list[Child] = []

    @property
    def children(self) -> list[Child]:
        return [*self.shard_procs, *self.drivers]

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        if self.plain:
            env = {k: v for k, v in env.items() if k != "GLIBC_TUNABLES"}
        if self.tree != ROOT:  # the other checkout's packages, before this one's (installed or not)
            env = {**env, "PYTHONPATH": os.pathsep.join((str(self.tree), env.get("PYTHONPATH", "")))}
        self.env, self.log_dir = env, log_dir
        tag = self.key.replace(" ", "").replace("×", "x")
        for r in range(self.workers):
            args = ("--rank", str(r), "--workers", str(self.workers), *(("--plain",) if self.plain else ()))
            self.spawn(f"{tag}-worker{r}", "grpc_ps.py", *args, env=env, log_dir=log_dir, driver=True, root=self.tree)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for c in self.drivers:
            c.recv(max(0.01, deadline - time.monotonic()), "start-up")

    def prepare(self, size: Size) -> None:
        tag = self.key.replace(" ", "").replace("×", "x")
        for k in range(self.shards):
            argv = shard_argv(k, self.shards, self.workers)
            if self.plain:  # the console script, as a user types it
                argv = [str(Path(PY).with_name("ps-server")), *argv[3:]]
            self.shard_procs.append(Child(f"{tag}-{size.label}-shard{k}", argv, self.env, self.log_dir, cwd=self.tree))

    def setup(self, size: Size) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        servers = [
            c.wait_for(r"listening on (\S+)", max(0.01, deadline - time.monotonic())).group(1) for c in self.shard_procs
        ]
        ask_all(
            self.drivers,
            "setup",
            SETUP_TIMEOUT,
            servers=servers,
            bytes=size.nbytes,
            model=size.model,
            partition_bytes=self.partition_bytes,
            wire_dtype=self.wire_dtype,
            data_path=self.data_path,
        )

    def finish(self, size: Size) -> None:
        ask_all(self.drivers, "close", SETUP_TIMEOUT)
        stop_all(self.shard_procs, grace=0.0)
        self.shard_procs = []

    def sides(self) -> dict[str, list[Child]]:
        return {"workers": self.drivers, "shards": self.shard_procs}

    def processes_to_prepare(self) -> int:
        return self.shards

    def memory_need(self, size: Size) -> int:
        return (self.workers + self.shards) * self.memory_factor * size.nbytes


def kib(n: int) -> str:
    return f"{n // 1024} KiB" if n < 1 << 20 else f"{n >> 20} MiB"


WIRE_SUFFIX = {"float32": "", "bfloat16": " bf16", "float16": " fp16"}


def systems_for(
    size: Size,
    quick: bool,
    partitions: Sequence[int],
    families: Sequence[str] = FAMILIES,
    grid: Sequence[tuple[int, int]] = GRID,
    wire_dtypes: Sequence[str] = ("float32",),
    before: bool = False,
) -> list[tuple[str, str, int, int, int, str]]:
    """(key, family, workers, shards, partition_bytes, wire dtype) measured at ``size``, of
    ``families`` only; ``before``: each grpc-ps configuration (but the plain start) twice, the
    second as ``KEY before`` (:data:`BEFORE`), to run another checkout's code."""
    out: list[tuple[str, str, int, int, int, str]] = [
        ("memcpy", "memcpy", 1, 0, 0, "float32"),
        ("loopback TCP", "tcp", 1, 0, 0, "float32"),
    ]
    out.append(("grpc echo", "echo", 1, 0, partitions[-1], "float32"))
    out += [("gloo all_reduce 2 ranks", "gloo", 2, 0, 0, "float32"), ("rpc PS 1w", "rpc", 1, 1, 0, "float32")]
    out.append(("rpc PS 2w", "rpc", 2, 1, 0, "float32"))
    grid = [(1, 1), (2, 2)] if quick else grid
    for wire in wire_dtypes:
        for w, s in grid:
            for pb in partitions:
                suffix = ("" if len(partitions) == 1 else f" p={kib(pb)}") + WIRE_SUFFIX[wire]
                out.append((f"grpc-ps {w}w×{s}s{suffix}", "grpc-ps", w, s, pb, wire))
    if (1, 1) in grid:  # gRPC alone: what the data connections buy (a whole call at ``small``)
        out.append(("grpc-ps 1w×1s gRPC only", "grpc-ps", 1, 1, partitions[-1], "grpc-only"))
    if (1, 1) in grid and size.model == "flat":
        out.append(("grpc-ps 1w×1s plain", "grpc-ps", 1, 1, partitions[-1], "plain"))
        out.append(("native PS prototype 1w", "native", 1, 1, partitions[-1], "float32"))
    if before:
        out += [(key + BEFORE, *rest) for key, *rest in out if rest[0] == "grpc-ps" and rest[-1] != "plain"]
    return [spec for spec in out if spec[1] in families]


BEFORE = " before"
"""The suffix of a configuration's twin that runs the checkout of ``run.py --before``."""


def build(
    key: str,
    family: str,
    workers: int,
    shards: int,
    partition_bytes: int,
    wire_dtype: str,
    before: Path | None = None,
) -> System:
    """The system of one :func:`systems_for` entry; ``before``: the checkout its ``BEFORE`` twins run."""
    tree = before if key.endswith(BEFORE) else None
    if family == "memcpy":
        return Memcpy(key)
    if family == "tcp":
        return Tcp(key)
    if family == "echo":
        return Echo(key, partition_bytes)
    if family == "native":
        return Native(key, partition_bytes)
    if family == "gloo":
        return Gloo(key)
    if family == "rpc":
        return RpcPS(key, workers)
    if wire_dtype == "plain":
        return GrpcPS(key, workers, shards, partition_bytes, "float32", plain=True)
    if wire_dtype == "grpc-only":
        return GrpcPS(key, workers, shards, partition_bytes, "float32", data_path="grpc", tree=tree)
    return GrpcPS(key, workers, shards, partition_bytes, wire_dtype, tree=tree)
