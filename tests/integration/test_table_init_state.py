"""Embedding tables as a DDP user sees them (docs/tables.md#initial-rows-and-the-state-dict): rows start from the
module's own weights (rank 0 seeds them), and ``model.state_dict()``/``client.state_dict()`` hold the trained
rows, which load into the plain model (strict). Sync, 2 workers (threads) over 2 shards, compared with one
process running torch's own optimizers on the summed batch: tables under ``SparseAdam``, the rest under
``Adam``; and the ``ctr`` workload's DLRM with DLRM's own U(-1/sqrt(rows), 1/sqrt(rows)) tables."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ps_common.tables import RowOptimizerSpec, TableSpec
from ps_worker import DistributedOptimizer, PSClient
from ps_worker.workloads.clicklog import ClickLogConfig
from ps_worker.workloads.ctr import CTRWorkload

RPC_TIMEOUT = 20.0
B = 8


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(300, 4, sparse=True)  # N(0, 1): nn.Embedding's own
        self.bag = nn.EmbeddingBag(200, 4, mode="sum", sparse=True)
        nn.init.uniform_(self.bag.weight, -(200**-0.5), 200**-0.5)  # DLRM's
        self.fc = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids: torch.Tensor, bag: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.emb(ids), self.bag(bag, offsets)], 1)).squeeze(1)


def batch(step: int, rank: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    ids = torch.randint(0, 300, (B,), generator=g)
    bag = torch.randint(0, 200, (2 * B,), generator=g)
    return ids, bag, torch.arange(0, 2 * B, 2), torch.randn(B, generator=g)


def optimizers(m: Model) -> list[torch.optim.Optimizer]:
    return [torch.optim.SparseAdam([m.emb.weight, m.bag.weight], lr=0.05), torch.optim.Adam(m.fc.parameters(), lr=1e-2)]


def run_ranks(addresses: list[str], num_workers: int, work: Callable[[int, PSClient], Any]) -> dict[int, Any]:
    """``work(rank, client)`` on ``num_workers`` threads, each with its own client; their results."""
    out: dict[int, Any] = {}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            with PSClient(addresses, rank=rank, num_workers=num_workers, timeout=RPC_TIMEOUT) as c:
                out[rank] = work(rank, c)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return out


def test_sparse_adam_and_adam_from_the_modules_weights_equal_one_process_read_from_state_dict(start_cluster) -> None:
    steps = 20
    cluster = start_cluster(num_shards=2, num_workers=2, mode="sync")
    models = {r: Model() for r in range(2)}  # built before the threads: torch's global generator is shared
    initial = {k: v.clone() for k, v in models[0].state_dict().items()}

    def work(rank: int, c: PSClient) -> tuple[dict[str, torch.Tensor], ...]:
        m = models[rank]
        opts = optimizers(m)
        c.init(m, opts)
        assert m.emb.weight is None and "bag.weight" not in dict(m.named_parameters())
        first = {k: v.clone() for k, v in m.state_dict().items()}  # before any step: the initial weights
        opt = DistributedOptimizer(m, c, opts)
        for step in range(steps):
            ids, bag, offsets, y = batch(step, rank)
            opt.zero_grad()
            F.mse_loss(m(ids, bag, offsets), y).backward()
            opt.step()
        buffer = io.BytesIO()
        torch.save(m.state_dict(), buffer)  # what a DDP script saves
        return first, torch.load(io.BytesIO(buffer.getvalue()), weights_only=True), c.state_dict()

    got = run_ranks(cluster.addresses, 2, work)
    for key, value in initial.items():
        assert torch.equal(got[0][0][key], value), key

    ref = Model()  # one process: torch's own optimizers on the summed batch
    opts = optimizers(ref)
    for step in range(steps):
        parts = [batch(step, r) for r in range(2)]
        ids, bag, y = (torch.cat([p[i] for p in parts]) for i in (0, 1, 3))
        for o in opts:
            o.zero_grad()
        F.mse_loss(ref(ids, bag, torch.arange(0, 4 * B, 2)), y).backward()
        for o in opts:
            o.step()
    want = ref.state_dict()
    for rank in range(2):
        saved, client_state = got[rank][1], got[rank][2]
        assert set(saved) == set(want) == set(client_state)
        for key in want:
            assert (saved[key] - want[key]).abs().max().item() <= 1e-5, key
            assert torch.equal(saved[key], client_state[key]), key
    plain = Model()
    plain.load_state_dict(got[0][1])  # strict: the plain (non-PS) model takes the saved file as it is
    assert torch.equal(plain.bag.weight, got[0][1]["bag.weight"])


CLICKLOG = ClickLogConfig(
    cardinalities=(400, 60, 20), zipf_exponents=(1.1, 1.2, 1.3), id_scales=(0.3, 0.5, 0.5), pairs=((1, 2),)
)


def dlrm(workload: CTRWorkload) -> nn.Module:
    """The ctr workload's DLRM with DLRM's own table initializer, U(-1/sqrt(rows), 1/sqrt(rows))."""
    torch.manual_seed(1)
    model = workload.model()
    for table in model.tables:
        bound = table.num_embeddings**-0.5
        nn.init.uniform_(table.weight, -bound, bound)
    return model


def test_dlrm_with_its_own_initializer_trains_as_one_process(start_cluster) -> None:
    steps, batch_size = 30, 64
    workload = CTRWorkload(CLICKLOG, train_size=steps * batch_size, held_out_size=512, dim=4)
    train, held_out = workload.datasets()
    x, y = train.tensors

    def adagrad(m: nn.Module) -> list[torch.optim.Optimizer]:
        tables = list(m.tables.parameters())
        dense = [p for n, p in m.named_parameters() if not n.startswith("tables.")]
        return [torch.optim.Adagrad(tables, lr=0.05), torch.optim.Adagrad(dense, lr=0.05)]

    cluster = start_cluster(num_shards=2, num_workers=1, mode="sync")
    model = dlrm(workload)

    def work(rank: int, c: PSClient) -> dict[str, float]:
        opts = adagrad(model)
        c.init(model, opts)
        opt = DistributedOptimizer(model, c, opts)
        for step in range(steps):
            rows = slice(step * batch_size, (step + 1) * batch_size)
            opt.zero_grad()
            workload.loss(model, x[rows], y[rows]).backward()
            opt.step()
        return workload.evaluate(model, held_out), model.state_dict()

    metrics, saved = run_ranks(cluster.addresses, 1, work)[0]
    with pytest.raises(RuntimeError, match="client is closed"):
        model.state_dict()  # the rows live on the shards: read them while the client is open

    ref = dlrm(workload)
    opts = adagrad(ref)
    for step in range(steps):
        rows = slice(step * batch_size, (step + 1) * batch_size)
        for o in opts:
            o.zero_grad()
        workload.loss(ref, x[rows], y[rows]).backward()
        for o in opts:
            o.step()
    want = ref.state_dict()
    assert set(saved) == set(want)
    for key in want:
        assert (saved[key] - want[key]).abs().max().item() <= 1e-5, key
    assert abs(metrics["auc"] - workload.evaluate(ref, held_out)["auc"]) <= 1e-4


def test_a_table_too_large_to_hold_starts_from_a_declared_uniform_initializer_the_shards_compute(
    start_cluster,
) -> None:
    """DLRM's U(-1/sqrt(rows), 1/sqrt(rows)) on a meta-device table: no row sent, none stored until pushed,
    every shard count reads the same rows."""
    rows, bound = 2**40, 2**-20
    ids = torch.tensor([0, 7, 2**39 + 3, rows - 1])
    answers = []
    for num_shards in (1, 3):
        cluster = start_cluster(num_shards=num_shards, num_workers=1, mode="sync")
        model = nn.Sequential(nn.EmbeddingBag(rows, 4, mode="sum", sparse=True, device="meta"), nn.Linear(4, 1))
        model[0].ps_init = ("uniform", -bound, bound)

        def work(rank: int, c: PSClient, model: nn.Module = model, cluster: Any = cluster) -> torch.Tensor:
            c.init(model, {"name": "adagrad", "lr": 0.1})
            got = c.pull_rows("0.weight", ids)
            assert c.tables.calls["InitTables"] == len(cluster.addresses)  # declared at the first pull: no row sent
            assert {s.shard.tables.tables["0.weight"].rows for s in cluster} == {0}  # none stored
            return got

        answers.append(run_ranks(cluster.addresses, 1, work)[0])
        for s in cluster:
            s.stop(grace=0.2)
    uniform = {"initializer": "uniform", "init_low": -bound, "init_high": bound}
    spec = TableSpec("0.weight", rows, 4, RowOptimizerSpec("adagrad", {"lr": 0.1}), **uniform)
    assert torch.equal(answers[0], answers[1]) and torch.equal(answers[0], spec.initial(ids))
    assert bool((answers[0].abs() <= bound).all()) and answers[0].abs().max() > bound / 4
