"""Every server optimizer through real shards: 2 shards holding a model split in partitions, 2 sync
workers; the parameters and the shards' optimizer state end bitwise those of the same torch.optim
optimizer stepping the whole model in one process with the rank-ordered mean gradient, also across
a checkpoint and a restart of every shard."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from ps_common.optimizer import OPTIMIZERS
from ps_worker import DistributedOptimizer, PSClient
from tests.conftest import RPC_TIMEOUT, small_model
from tests.helpers.optimizer_cases import CASES, Case, torch_groups
from tests.helpers.ranks import problem

N = 2  # workers
STEPS = 8  # RAdam's rectified branch starts at step 6 (beta2 0.9); ASGD averages after t0
BATCH = 4
PARTITION_BYTES = 256  # small_model's 0.weight (512 bytes) splits; partitions spread over both shards
X, Y = problem(STEPS * N * BATCH, 8, seed=11)


def train(addresses: list[str], case: Case, start: int, steps: int) -> list[torch.nn.Module]:
    """Ranks 0..N-1 in threads run steps ``start .. start + steps``: at step t rank r trains on the
    (t N + r)-th batch; the case's hyperparameter changes of steps before ``start`` are set first
    (a resumed worker carries them), each later one at its step."""
    models = [small_model() for _ in range(N)]
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            m = models[rank]
            with PSClient(
                addresses, rank=rank, num_workers=N, incarnation=1, timeout=RPC_TIMEOUT, partition_bytes=PARTITION_BYTES
            ) as c:
                c.init(m, case.spec)
                opt = DistributedOptimizer(m, c)
                for t in range(start + steps):
                    opt.param_groups[0].update(case.changes.get(t, ({}, {}))[0])
                    if t < start:
                        continue
                    lo = (t * N + rank) * BATCH
                    opt.zero_grad()
                    F.cross_entropy(m(X[lo : lo + BATCH]), Y[lo : lo + BATCH]).backward()
                    opt.step()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, errors
    return models


def reference(case: Case, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """One process: each step, every rank's gradient on its batch, their mean summed in rank order
    (the shards' ``aggregate``), one step of the torch optimizer over the whole model."""
    model = small_model()
    named = dict(model.named_parameters())
    opt = case.torch_optimizer(torch_groups(case, named))
    for t in range(steps):
        opt.param_groups[0].update(case.changes.get(t, ({}, {}))[1])
        per_rank = []
        for r in range(N):
            model.zero_grad(set_to_none=True)
            lo = (t * N + r) * BATCH
            F.cross_entropy(model(X[lo : lo + BATCH]), Y[lo : lo + BATCH]).backward()
            per_rank.append({k: p.grad for k, p in named.items()})
        for k, p in named.items():
            p.grad = torch.add(per_rank[0][k], per_rank[1][k]).div_(N)
        opt.step()
    return model, opt


def assert_bitwise(
    models: list[torch.nn.Module], shards: list, want: torch.nn.Module, opt: torch.optim.Optimizer
) -> None:
    """Every worker's parameters, and every shard's partitions of them and of their optimizer state
    (tensors the shape of the parameter: that slice; per-parameter scalars such as the step:
    whole), bitwise the reference's; every shard's param groups hold the reference's arguments."""
    named = dict(want.named_parameters())
    for m in models:
        for k, p in m.named_parameters():
            assert torch.equal(p, named[k]), k
    owned = 0
    for server in shards:
        store = server.shard.store
        for group, ref_group in zip(store.optimizer.param_groups, opt.param_groups, strict=True):
            assert {k: v for k, v in group.items() if k != "params"} == {
                k: v for k, v in ref_group.items() if k != "params"
            }  # flags, pairs as torch's tuples, pushed changes
        for part, t in zip(store.partitions, store.tensors, strict=True):
            owned += 1
            ref = named[part.key]
            assert torch.equal(t, ref.detach().flatten()[part.offset : part.offset + part.length]), part
            got, expected = store.optimizer.state[t], opt.state[ref]
            assert got.keys() == expected.keys(), part
            for name, v in got.items():
                w = expected[name]
                if isinstance(w, torch.Tensor) and w.shape == ref.shape:
                    w = w.flatten()[part.offset : part.offset + part.length]
                assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (part, name)
    assert owned > len(named)  # the model is split: more partitions than parameters
    assert all(server.shard.store.partitions for server in shards)  # over both shards


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_every_optimizer_through_the_shards_is_bitwise_torch_optim(start_cluster, case_id: str) -> None:
    case = CASES[case_id]
    shards = start_cluster(num_shards=2, num_workers=N)
    models = train(shards.addresses, case, 0, STEPS)
    assert_bitwise(models, shards, *reference(case, STEPS))


def test_the_cases_cover_every_optimizer() -> None:
    assert {c.name for c in CASES.values()} == set(OPTIMIZERS)


# one case per optimizer, flags and pair changes included
RESUMED = {name: max(k for k, c in CASES.items() if c.name == name) for name in OPTIMIZERS}


@pytest.mark.parametrize("case_id", sorted(RESUMED.values()))
def test_every_optimizer_s_state_survives_a_checkpoint_and_restart_bitwise(start_cluster, tmp_path, case_id) -> None:
    """Half the steps, every shard stopped (its final checkpoint), restarted from it, the other
    half by workers that rejoin: bitwise the uninterrupted reference."""
    case = CASES[case_id]
    shards = start_cluster(num_shards=2, num_workers=N, checkpoint_dir=str(tmp_path))
    train(shards.addresses, case, 0, STEPS // 2)
    for s in shards:
        s.stop(grace=0.5)
    restarted = [start_cluster.restart(s) for s in shards]
    assert all(s.shard.restored_from_version == STEPS // 2 for s in restarted)
    models = train([s.address for s in restarted], case, STEPS // 2, STEPS - STEPS // 2)
    assert_bitwise(models, restarted, *reference(case, STEPS))
