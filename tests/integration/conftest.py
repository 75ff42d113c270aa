"""Fixtures of the integration tests: one way to start in-process shards (``start_cluster``), a background
trainer, external tools."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from ps_server.config import ServerConfig
from ps_server.server import ShardServer, start_server
from ps_worker import DistributedOptimizer, PSClient
from ps_worker.metrics import WorkerMetrics
from tests.helpers import namespaces as netns


def find_tool(name: str) -> str:
    """Path of an external command (PATH, then this interpreter's bin/); skips the test when it is
    missing, except in CI (``CI=true``), where a missing tool fails it."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found:
        return found
    message = f"{name} is not installed; run .ci/install-ops-tools.sh (and pip install -e '.[dev]')"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{message}: CI must run this test.")
    pytest.skip(message)


def poll(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Call ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str, str]]:
    """Two network namespaces joined by a veth pair (:func:`tests.helpers.namespaces.namespaces`)."""
    yield from netns.namespaces()


@pytest.fixture
def tool() -> Callable[[str], str]:
    return find_tool


@pytest.fixture
def wait_until() -> Callable[..., Any]:
    return poll


class Cluster(list[ShardServer]):
    """Shards started together, shard ``k`` at index ``k``."""

    @property
    def addresses(self) -> list[str]:
        """``host:port`` of every shard, in shard order (what ``PSClient`` and ``--servers`` take)."""
        return [s.address for s in self]


class Clusters:
    """Starts in-process shards on 127.0.0.1:0 and stops every one it started (:meth:`stop_all`).

    Call it as ``start_cluster(num_shards=2, num_workers=2, **config)``: ``config`` is any other
    :class:`ServerConfig` field; ``/metrics`` is served on a free port unless ``metrics_port`` says
    otherwise. :meth:`ShardServer.stop` joins each shard's threads (the lease reaper, the gRPC pools,
    the checkpoint writer), so a test leaves none behind.
    """

    def __init__(self) -> None:
        self.started: list[ShardServer] = []

    def __call__(self, num_shards: int = 2, num_workers: int = 2, **config: Any) -> Cluster:
        config.setdefault("metrics_port", 0)
        config.setdefault("host", "127.0.0.1")
        configs = [
            ServerConfig(shard_index=k, num_shards=num_shards, num_workers=num_workers, port=0, **config)
            for k in range(num_shards)
        ]
        return Cluster(self.start(c) for c in configs)

    def start(self, config: ServerConfig) -> ShardServer:
        """Start one shard of exactly ``config`` (a restart: the config of a stopped shard, with
        ``port`` set to its old port to come back on the same address)."""
        server = start_server(config)
        self.started.append(server)
        return server

    def restart(self, server: ShardServer, same_port: bool = False) -> ShardServer:
        """Start ``server``'s config again (on a new free port, or on its old one)."""
        return self.start(replace(server.config, port=server.port if same_port else 0))

    def stop_all(self, grace: float = 0.5) -> None:
        """Stop every shard the test did not stop itself (a second stop would write another final checkpoint)."""
        for s in self.started:
            if not s.stopped:
                s.stop(grace=grace)


@pytest.fixture
def start_cluster() -> Iterator[Clusters]:
    """``start_cluster(num_shards=2, num_workers=2, **config)`` -> a :class:`Cluster` of running shards;
    all stopped (threads joined) at teardown. Also ``start_cluster.start(config)`` and ``.restart``."""
    clusters = Clusters()
    yield clusters
    clusters.stop_all()


@pytest.fixture(scope="module")
def start_module_cluster() -> Iterator[Clusters]:
    """:func:`start_cluster` for module-scoped fixtures: the shards live until the module's tests end."""
    clusters = Clusters()
    yield clusters
    clusters.stop_all()


class Trainer:
    """One worker rank training a small model in a thread until :meth:`stop` or ``max_steps``."""

    def __init__(
        self,
        addresses: list[str],
        rank: int = 0,
        num_workers: int = 1,
        *,
        metrics: WorkerMetrics | None = None,
        max_steps: int = 100_000,
        pace: float = 0.0,
        token: str | None = None,
        retry_deadline: float = 5.0,
    ) -> None:
        self.addresses = addresses
        self.retry_deadline = retry_deadline
        self.rank = rank
        self.num_workers = num_workers
        self.metrics = metrics
        self.max_steps = max_steps
        self.pace = pace
        self.token = token
        self.steps = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"trainer-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
            with PSClient(
                self.addresses,
                rank=self.rank,
                num_workers=self.num_workers,
                timeout=10,
                retry_deadline=self.retry_deadline,
                token=self.token,
                metrics=self.metrics,
            ) as client:
                client.init(model, {"name": "sgd", "lr": 0.01}, init_timeout=20)
                opt = DistributedOptimizer(model, client)
                x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
                while self.steps < self.max_steps and not self._stop.is_set():
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                    self.steps += 1
                    if self.pace:
                        self._stop.wait(self.pace)
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def stop(self, timeout: float = 20.0) -> None:
        """Stop after the current step and re-raise the thread's error, if any."""
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"trainer rank {self.rank} did not stop within {timeout} s"
        if self.error is not None:
            raise self.error


@pytest.fixture
def start_trainer() -> Iterator[Callable[..., Trainer]]:
    """``start_trainer(addresses, rank=0, num_workers=1, **kw)``; every trainer stopped at teardown."""
    trainers: list[Trainer] = []

    def start(addresses: list[str], rank: int = 0, num_workers: int = 1, **kw: Any) -> Trainer:
        t = Trainer(addresses, rank, num_workers, **kw)
        trainers.append(t)
        return t

    yield start
    for t in trainers:
        t._stop.set()
    for t in trainers:
        t._thread.join(20)
