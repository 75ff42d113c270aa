"""Sync mode is exact: N workers x batch b == one process with batch N*b; timing never changes bits."""

from __future__ import annotations

import random
import threading
import time

import torch
import torch.nn.functional as F

from ps_worker import DistributedOptimizer, PSClient
from ps_worker.train import params_sha256
from tests.conftest import RPC_TIMEOUT, small_model

STEPS = 20

BATCH = 8
OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def data(n: int, seed: int = 123) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(STEPS * n * BATCH, 8, generator=g), torch.randint(0, 3, (STEPS * n * BATCH,), generator=g)


def run_workers(addresses: list[str], n: int, delays: bool, seed: int = 0) -> list[torch.nn.Module]:
    """``n`` worker threads; at step t, rank r trains on samples [nbt + rb, nbt + (r+1)b)."""
    x, y = data(n)
    # built here, one after another: small_model() seeds torch's global RNG, which threads share
    initial = [small_model() for _ in range(n)]
    models: list[torch.nn.Module | None] = [None] * n
    errors: list[BaseException] = []
    rng = random.Random(seed)
    pauses = [[rng.uniform(0, 0.01) if delays else 0.0 for _ in range(STEPS)] for _ in range(n)]

    def work(rank: int) -> None:
        try:
            model = initial[rank]
            with PSClient(addresses, rank=rank, num_workers=n, incarnation=1, timeout=RPC_TIMEOUT) as client:
                client.init(model, OPTIMIZER)
                opt = DistributedOptimizer(model, client)
                for t in range(STEPS):
                    lo = n * BATCH * t + rank * BATCH
                    opt.zero_grad()
                    F.cross_entropy(model(x[lo : lo + BATCH]), y[lo : lo + BATCH]).backward()
                    time.sleep(pauses[rank][t])  # artificial push delay, not synchronization
                    opt.step()
            models[rank] = model
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert all(m is not None for m in models)
    return models  # type: ignore[return-value]


def test_two_workers_equal_one_process_with_double_batch(start_cluster) -> None:
    shards = start_cluster(num_shards=2, num_workers=2)
    models = run_workers([s.address for s in shards], n=2, delays=False)
    x, y = data(2)
    reference = small_model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for t in range(STEPS):
        lo = 2 * BATCH * t
        opt.zero_grad()
        F.cross_entropy(reference(x[lo : lo + 2 * BATCH]), y[lo : lo + 2 * BATCH]).backward()
        opt.step()
    for model in models:
        for (key, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            diff = (p - q).abs().max().item()
            assert diff <= 1e-5, f"{key}: max abs difference {diff}"
    assert params_sha256(models[0]) == params_sha256(models[1])
    assert all(s.shard.status().version == STEPS for s in shards)


def test_random_push_delays_give_bitwise_identical_parameters(start_cluster) -> None:
    """Three workers, so that summing in arrival order (not associative) would change the bits."""
    digests = []
    for seed in (1, 2):
        shards = start_cluster(num_shards=2, num_workers=3)
        models = run_workers([s.address for s in shards], n=3, delays=True, seed=seed)
        digests.append(params_sha256(models[0]))
        assert all(params_sha256(m) == digests[-1] for m in models)
        for s in shards:
            s.stop(grace=0.5)
    assert digests[0] == digests[1]
