"""torch.optim optimizers given to client.init and DistributedOptimizer, through real shards:
nanoGPT's decay groups by identity, schedulers on the user's optimizer, easgd's local optimizer,
SparseAdam on the tables with a scheduled lr, refusals (ps_worker.torch_optim)."""

from __future__ import annotations

import logging

import grpc
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ps_worker import DistributedOptimizer, PSClient
from tests.conftest import RPC_TIMEOUT, small_model
from tests.integration.test_ddp_semantics import BATCH, assert_close, data, run_ranks, warmup_cosine


def decay_groups(model: nn.Module, lr: float) -> torch.optim.AdamW:
    """nanoGPT's configure_optimizers: 2-D weights decay, biases do not; by parameter identity."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
        fused=False,
    )


def train(addresses, n: int, steps: int, make_opt, sched=None, dict_spec=None) -> list[nn.Module]:
    """``n`` sync ranks; each builds its optimizer from its model, then init, then wraps it."""
    x, y = data(steps * n * BATCH)
    models = [small_model() for _ in range(n)]

    def work(rank: int) -> nn.Module:
        model = models[rank]
        user = make_opt(model)
        with PSClient(addresses, rank=rank, num_workers=n, incarnation=1, timeout=RPC_TIMEOUT) as client:
            client.init(model, dict_spec if dict_spec is not None else user)
            opt = (
                DistributedOptimizer(model, client)
                if dict_spec is not None
                else DistributedOptimizer(model, client, user)
            )
            scheduler = sched(user) if sched else None  # on the user's optimizer, as the script had it
            for t in range(steps):
                opt.zero_grad()
                lo = t * n * BATCH + rank * BATCH
                F.cross_entropy(model(x[lo : lo + BATCH]), y[lo : lo + BATCH]).backward()
                opt.step()
                if scheduler:
                    scheduler.step()
        return model

    return run_ranks(n, work)


def reference(n: int, steps: int, make_opt, sched) -> nn.Module:
    """One process stepping torch on the mean gradient of the batches the ranks saw."""
    x, y = data(steps * n * BATCH)
    model = small_model()
    opt = make_opt(model)
    scheduler = sched(opt)
    for t in range(steps):
        opt.zero_grad()
        lo = t * n * BATCH
        F.cross_entropy(model(x[lo : lo + n * BATCH]), y[lo : lo + n * BATCH]).backward()
        opt.step()
        scheduler.step()
    return model


def test_adamw_decay_groups_instance_equals_the_dict_spec_bitwise(start_cluster) -> None:
    addresses = start_cluster(num_shards=2, num_workers=2).addresses
    steps = 5
    given = train(addresses, 2, steps, lambda m: decay_groups(m, 1e-2))
    biases = ["0.bias", "2.bias"]
    spec = {
        "name": "adamw",
        "lr": 1e-2,
        "beta1": 0.9,
        "beta2": 0.95,
        "weight_decay": 0.1,
        "groups": [{"params": biases, "weight_decay": 0.0}],
    }
    addresses = start_cluster(num_shards=2, num_workers=2).addresses
    by_dict = train(addresses, 2, steps, lambda m: decay_groups(m, 1e-2), dict_spec=spec)
    for a, b in zip(given[0].state_dict().values(), by_dict[0].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(given[0][0].weight, small_model()[0].weight)


def test_a_scheduler_on_the_users_optimizer_reaches_the_shards(start_cluster) -> None:
    shards = start_cluster(num_shards=2, num_workers=2)
    steps = 8

    def sched(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(2, steps))

    def make(m: nn.Module) -> torch.optim.Optimizer:
        return decay_groups(m, 5e-2)

    models = train(shards.addresses, 2, steps, make, sched)
    for m in models:
        assert_close(m, reference(2, steps, make, sched))
    final = 5e-2 * warmup_cosine(2, steps)(steps - 1)
    assert all(s.shard.status().learning_rate == pytest.approx(final) for s in shards)


def test_easgd_step_lr_on_the_distributed_optimizer_moves_the_local_lr(start_cluster) -> None:
    shards = start_cluster(num_shards=1, num_workers=1, mode="easgd", communication_period=2)
    model = small_model()
    local = torch.optim.Adadelta(model.parameters(), lr=1.0)
    x, y = data(4 * BATCH)
    with PSClient(shards.addresses, rank=0, num_workers=1, timeout=RPC_TIMEOUT) as client:
        client.init(model, {"name": "sgd", "lr": 0.1})
        for opt in (
            DistributedOptimizer(model, client, local),
            DistributedOptimizer(model, client, local_optimizer=local),
        ):
            scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            assert opt.local_optimizer is local
            for t in range(2):
                opt.zero_grad()
                F.cross_entropy(model(x[t * BATCH : (t + 1) * BATCH]), y[t * BATCH : (t + 1) * BATCH]).backward()
                opt.step()
                scheduler.step()
            assert local.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
        assert local.param_groups[0]["lr"] == pytest.approx(1.0 * 0.5**4)
        assert client.exchanges == 2


class Ctr(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.bag = nn.EmbeddingBag(rows, 4, mode="sum", sparse=True)
        self.fc = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bag(ids, offsets)).squeeze(1)


def ctr_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (
        torch.randint(0, rows, (2 * BATCH,), generator=g),
        torch.arange(0, 2 * BATCH, 2),
        torch.randn(BATCH, generator=g),
    )


def ctr_optimizers(model: Ctr) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    return torch.optim.Adam(model.fc.parameters(), lr=1e-2), torch.optim.SparseAdam(model.bag.parameters(), lr=0.1)


def test_sparse_adam_and_adam_rows_take_the_scheduled_lr(start_cluster) -> None:
    rows, steps = 30, 5
    shards = start_cluster(num_shards=2, num_workers=1)
    model = Ctr(rows)
    dense, sparse = ctr_optimizers(model)  # built from the model, before init
    with PSClient(shards.addresses, rank=0, num_workers=1, timeout=RPC_TIMEOUT) as client:
        client.init(model, [dense, sparse])
        assert "bag.weight" not in dict(model.named_parameters())
        opt = DistributedOptimizer(model, client, [dense, sparse])
        schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (dense, sparse)]
        start = {k: v.clone() for k, v in model.state_dict().items()}
        for t in range(steps):
            ids, offsets, target = ctr_batch(t, rows)
            opt.zero_grad()
            F.mse_loss(model(ids, offsets), target).backward()
            opt.step()
            for s in schedulers:
                s.step()
        got = client.pull_rows("bag.weight", torch.arange(rows))
        fc = {k: v.clone() for k, v in model.state_dict().items()}

    ref = Ctr(rows)  # one process: torch's SparseAdam on the table, Adam on the head, same schedule
    ref.load_state_dict(start)  # the table's rows too: rank 0 seeded them from the module's weight
    optimizers = ctr_optimizers(ref)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in optimizers]
    for t in range(steps):
        ids, offsets, target = ctr_batch(t, rows)
        for o in optimizers:
            o.zero_grad()
        F.mse_loss(ref(ids, offsets), target).backward()
        for o in optimizers:
            o.step()
        for s in schedulers:
            s.step()
    assert (got - ref.bag.weight.detach()).abs().max().item() <= 1e-6
    assert (fc["fc.weight"] - ref.fc.weight.detach()).abs().max().item() <= 1e-6
    assert sparse.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**steps)


def test_bad_row_hyperparameters_are_refused(start_cluster) -> None:
    shards = start_cluster(num_shards=1, num_workers=1)
    model = Ctr(10)
    with PSClient(shards.addresses, rank=0, num_workers=1, timeout=RPC_TIMEOUT) as client:
        client.init(model, list(ctr_optimizers(model)))
        ids, grads = torch.tensor([1, 2]), torch.ones(2, 4)
        before = client.pull_rows("bag.weight", ids)
        for hyper, match in [
            ({"lr": -1.0}, "finite number >= 0"),
            ({"beta1": 1.5}, "out of range"),
            ({"momentum": 0.9}, "not 'momentum'"),
        ]:
            with pytest.raises(grpc.RpcError, match=match) as exc:
                client.tables.push({"bag.weight": (ids, grads)}, hyper)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert torch.equal(client.pull_rows("bag.weight", ids), before)
        client.tables.push({"bag.weight": (ids, grads)}, {"lr": 0.0})  # lr 0 stays in force: rows unchanged
        client.tables.push({"bag.weight": (ids, grads)})
        assert torch.equal(client.pull_rows("bag.weight", ids), before)


def test_lbfgs_is_refused_at_init_naming_what_runs(start_cluster) -> None:
    shards = start_cluster(num_shards=1, num_workers=1)
    model = small_model()
    with PSClient(shards.addresses, rank=0, num_workers=1, timeout=RPC_TIMEOUT) as client:
        with pytest.raises(
            ValueError, match=r"LBFGS does not run on the shards \(it needs a closure.*they run SGD, Adam"
        ):
            client.init(model, torch.optim.LBFGS(model.parameters()))


def test_from_env_without_an_optimizer_says_what_it_uses(start_cluster, caplog) -> None:
    shards = start_cluster(num_shards=1, num_workers=1)
    environ = {"PS_SERVERS": ",".join(shards.addresses), "PS_RANK": "0", "PS_NUM_WORKERS": "1"}
    with caplog.at_level(logging.WARNING, logger="ps_worker.env"):
        PSClient.from_env(small_model(), environ=environ, timeout=RPC_TIMEOUT).close()
    assert "PS_OPTIMIZER is unset: the shards run name sgd lr 0.1 momentum 0.9" in caplog.text
    caplog.clear()
    model = small_model()
    with caplog.at_level(logging.WARNING, logger="ps_worker.env"):
        PSClient.from_env(
            model, torch.optim.SGD(model.parameters(), lr=0.1), environ=environ, timeout=RPC_TIMEOUT
        ).close()
    assert "PS_OPTIMIZER" not in caplog.text
