"""Worker ranks as threads of the test process, each training its own copy of a small classifier
with ``DistributedOptimizer`` in sync mode against real shards."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ps_worker import DistributedOptimizer, PSClient
from tests.conftest import RPC_TIMEOUT


def problem(samples: int, features: int = 16, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded classification problem: ``samples`` x ``features`` float32 inputs, labels in 0..2."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(samples, features, generator=g), torch.randint(0, 3, (samples,), generator=g)


def train_ranks(
    addresses: list[str],
    n: int,
    model: Callable[[], torch.nn.Module],
    steps: int,
    batch: int,
    optimizer: dict[str, Any],
    *,
    before_step: Callable[[int, int], None] | None = None,
    overlap: bool = False,
    features: int = 16,
    seed: int = 7,
    **client: Any,
) -> tuple[list[torch.nn.Module], list[list[bool]]]:
    """``n`` ranks, ``steps`` steps each on :func:`problem` (rank r takes the r-th ``batch`` of each
    step's ``n * batch`` samples); ``before_step(rank, step)`` runs in each rank after its backward,
    before its ``step()``; ``client`` goes to ``PSClient`` (``data_path``, ``partition_bytes``,
    ``wire_dtype``). The models are built one after another before the threads start (``model``
    may seed torch's global RNG, which threads share).

    Returns:
        The models, and per rank whether each shard's data connection was open at the end.
    """
    x, y = problem(steps * n * batch, features, seed)
    models = [model() for _ in range(n)]
    connected: list[list[bool]] = [[] for _ in range(n)]
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            m = models[rank]
            with PSClient(addresses, rank=rank, num_workers=n, incarnation=1, timeout=RPC_TIMEOUT, **client) as c:
                c.init(m, optimizer)
                opt = DistributedOptimizer(m, c, overlap=overlap)
                for t in range(steps):
                    lo = n * batch * t + rank * batch
                    opt.zero_grad()
                    F.cross_entropy(m(x[lo : lo + batch]), y[lo : lo + batch]).backward()
                    if before_step is not None:
                        before_step(rank, t)
                    opt.step()
                connected[rank] = c.transport.data_connected
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return models, connected
