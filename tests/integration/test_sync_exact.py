"""Sync mode is exact: N workers x batch b == one process with batch N*b; timing never changes bits."""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

from ps_worker.workloads.train import params_sha256
from tests.conftest import small_model
from tests.helpers.ranks import problem, train_ranks

STEPS = 20

BATCH = 8
OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def data(n: int, seed: int = 123) -> tuple[torch.Tensor, torch.Tensor]:
    return problem(STEPS * n * BATCH, 8, seed)


def run_workers(addresses: list[str], n: int, delays: bool, seed: int = 0) -> list[torch.nn.Module]:
    """``n`` worker threads; at step t, rank r trains on samples [nbt + rb, nbt + (r+1)b)."""
    rng = random.Random(seed)
    pauses = [[rng.uniform(0, 0.01) if delays else 0.0 for _ in range(STEPS)] for _ in range(n)]

    def pause(rank: int, t: int) -> None:
        time.sleep(pauses[rank][t])  # artificial push delay, not synchronization

    models, _ = train_ranks(addresses, n, small_model, STEPS, BATCH, OPTIMIZER, before_step=pause, features=8, seed=123)
    return models


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
