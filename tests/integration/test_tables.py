"""Embedding tables over real gRPC: a model's sparse embeddings trained through
DistributedOptimizer (sync: bitwise reproducible, equal to one process on the summed batch),
pull_rows/push_rows, refusals that change nothing, checkpoints, GetStatus and Prometheus."""

from __future__ import annotations

import subprocess
import threading
import urllib.request
from typing import Any

import grpc
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ps_common.tables import RowOptimizerSpec, TableSpec, initial_rows, shard_of
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_worker import DistributedOptimizer, PSClient
from ps_worker.tables.modules import prefetch

RPC_TIMEOUT = 20.0
B = 8


class Model(nn.Module):
    """An nn.Embedding and an nn.EmbeddingBag (sparse=True: shard tables) and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 4, sparse=True)
        self.bag = nn.EmbeddingBag(500, 4, mode="sum", sparse=True)
        self.fc = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor, bag: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.emb(ids), self.bag(bag, offsets)], 1)).squeeze(1)


def batch(step: int, rank: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    ids = torch.randint(0, 1000, (B,), generator=g)
    bag = torch.randint(0, 500, (2 * B,), generator=g)
    return ids, bag, torch.arange(0, 2 * B, 2), torch.randn(B, generator=g)


OPTIMIZER = {"name": "sgd", "lr": 0.1, "sparse": {"name": "adagrad", "lr": 0.5}}


def train(addresses: list[str], num_workers: int, steps: int) -> dict[int, Any]:
    """Train ``num_workers`` ranks (threads) for ``steps`` sync steps; every rank's final tables and head."""
    models = {}
    for r in range(num_workers):
        torch.manual_seed(0)  # before the threads: torch's global generator is shared
        models[r] = Model()
    out: dict[int, Any] = {}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            m = models[rank]
            with PSClient(addresses, rank=rank, num_workers=num_workers, timeout=RPC_TIMEOUT) as c:
                c.init(m, dict(OPTIMIZER))
                assert "emb.weight" not in dict(m.named_parameters()) and m.emb.weight is None
                opt = DistributedOptimizer(m, c)
                for step in range(steps):
                    ids, bag, offsets, y = batch(step, rank)
                    opt.zero_grad()
                    F.mse_loss(m(ids, bag, offsets), y).backward()
                    opt.step()
                out[rank] = (
                    c.pull_rows("emb.weight", torch.arange(1000)),
                    c.pull_rows("bag.weight", torch.arange(500)),
                    torch.cat([p.detach().flatten() for p in m.fc.parameters()]),
                )
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return out


def reference(num_workers: int, steps: int) -> tuple[torch.Tensor, ...]:
    """One process, the summed batch, torch's own sparse Adagrad from the model's own initial rows
    (rank 0 seeds the shards with them)."""
    torch.manual_seed(0)
    m = Model()
    dense = torch.optim.SGD(m.fc.parameters(), lr=0.1)
    sparse = torch.optim.Adagrad([m.emb.weight, m.bag.weight], lr=0.5)
    for step in range(steps):
        parts = [batch(step, r) for r in range(num_workers)]
        ids, bag, y = (torch.cat([p[i] for p in parts]) for i in (0, 1, 3))
        dense.zero_grad()
        sparse.zero_grad()
        F.mse_loss(m(ids, bag, torch.arange(0, 2 * B * num_workers, 2)), y).backward()
        dense.step()
        sparse.step()
    head = torch.cat([p.detach().flatten() for p in m.fc.parameters()])
    return m.emb.weight.detach(), m.bag.weight.detach(), head


def test_sync_tables_are_bitwise_reproducible_and_equal_one_process(start_cluster) -> None:
    runs = []
    for _ in range(2):
        cluster = start_cluster(num_shards=2, num_workers=2, mode="sync")
        runs.append(train(cluster.addresses, 2, steps=4))
        for s in cluster:
            s.stop(grace=0.2)
    first, second = runs
    for a, b in zip(first[0], second[0], strict=True):
        assert torch.equal(a, b)  # run after run, the same bits
    for a, b in zip(first[0], first[1], strict=True):
        assert torch.equal(a, b)  # every rank reads the same tables
    for got, want in zip(first[0], reference(2, steps=4), strict=True):
        assert torch.allclose(got, want, atol=1e-5, rtol=0)


def _joined(addresses: list[str], num_rows: int = 100, dim: int = 4) -> PSClient:
    c = PSClient(addresses, rank=0, num_workers=1, timeout=RPC_TIMEOUT, retry_deadline=5)
    c.join()
    c.init_tables([TableSpec("t", num_rows, dim, RowOptimizerSpec("sgd", {"lr": 1.0}), seed=7)])
    return c


def test_pull_and_push_rows_touch_only_the_rows_sent(start_cluster) -> None:
    cluster = start_cluster(num_shards=2, num_workers=1, mode="async")
    with _joined(cluster.addresses, num_rows=2**63 - 1) as c:
        ids = torch.tensor([5, 2**62 + 11, 5, 17])
        before = c.pull_rows("t", ids)
        assert torch.equal(before, initial_rows("t", 7, 1.0, ids, 4))
        c.push_rows({"t": (ids, torch.ones(4, 4))})  # id 5 twice: its rows are summed
        after = c.pull_rows("t", ids)
        assert torch.equal(after[0], before[0] - 2) and torch.equal(after[1], before[1] - 1)
        rows = [s.shard.tables.tables["t"].rows for s in cluster]
        owners = shard_of(torch.tensor([5, 2**62 + 11, 17]), 2)
        assert rows == [int((owners == k).sum()) for k in range(2)]  # each shard holds only its rows


def _refused(call: Any, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    return err.value.details()


def test_bad_rows_are_refused_with_contract_codes_and_change_nothing(start_cluster) -> None:
    (shard,) = start_cluster(num_shards=1, num_workers=1, mode="async", max_table_rows=3)
    with _joined([shard.address], num_rows=100) as c:
        snapshot = shard.shard.tables.export()
        ids = torch.tensor([1, 2])
        _refused(lambda: c.pull_rows("t", torch.tensor([100])), grpc.StatusCode.INVALID_ARGUMENT)
        _refused(lambda: c.push_rows({"t": (torch.tensor([-1]), torch.ones(1, 4))}), grpc.StatusCode.INVALID_ARGUMENT)
        nan = torch.ones(2, 4)
        nan[1, 2] = float("nan")
        _refused(lambda: c.push_rows({"t": (ids, nan)}), grpc.StatusCode.INVALID_ARGUMENT)
        full = torch.arange(10)
        assert "max-table-rows" in _refused(
            lambda: c.push_rows({"t": (full, torch.ones(10, 4))}), grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        with grpc.insecure_channel(shard.address) as ch:
            stub = ps_pb2_grpc.ParameterServiceStub(ch)
            wrong_dim = ps_pb2.PushRowsRequest(
                rank=0,
                incarnation=c.session.incarnation,
                session=c.session.sessions[0],
                clock=99,
                blocks=[ps_pb2.RowBlock(table="t", ids=ids.numpy().tobytes(), dtype=1, data=bytes(2 * 5 * 4))],
            )
            assert "dim" in _refused(
                lambda: stub.PushRows(wrong_dim, timeout=RPC_TIMEOUT), grpc.StatusCode.INVALID_ARGUMENT
            )
            unknown = ps_pb2.PullRowsRequest(
                rank=0, incarnation=c.session.incarnation, blocks=[ps_pb2.RowBlock(table="u")]
            )
            _refused(lambda: stub.PullRows(unknown, timeout=RPC_TIMEOUT), grpc.StatusCode.INVALID_ARGUMENT)
            huge = ps_pb2.PullRowsRequest(
                rank=0, incarnation=c.session.incarnation, blocks=[ps_pb2.RowBlock(table="t", ids=bytes(8 * 1_000_000))]
            )
            _refused(lambda: stub.PullRows(huge, timeout=RPC_TIMEOUT), grpc.StatusCode.RESOURCE_EXHAUSTED)
            other = ps_pb2.InitTablesRequest(
                rank=0,
                incarnation=c.session.incarnation,
                tables=[
                    ps_pb2.TableSpec(
                        name="t", num_rows=100, dim=5, optimizer=ps_pb2.OptimizerSpec(name="sgd", kwargs={"lr": 1})
                    )
                ],
            )
            _refused(lambda: stub.InitTables(other, timeout=RPC_TIMEOUT), grpc.StatusCode.FAILED_PRECONDITION)
        after = shard.shard.tables.export()
        assert after["version"] == snapshot["version"] and after["tables"][0]["ids"].numel() == 0
        c.push_rows({"t": (ids, torch.ones(2, 4))})  # still serving
        assert shard.shard.tables.tables["t"].rows == 2


@pytest.mark.parametrize("mode", ["easgd", "diloco"])
def test_local_optimizer_modes_refuse_tables_at_init_tables(start_cluster, mode: str) -> None:
    (shard,) = start_cluster(num_shards=1, num_workers=1, mode=mode)
    with PSClient([shard.address], rank=0, num_workers=1, timeout=RPC_TIMEOUT, retry_deadline=5) as c:
        c.join()
        spec = TableSpec("t", 100, 4, RowOptimizerSpec("sgd", {"lr": 1.0}), seed=7)
        assert f"not served in {mode}" in _refused(lambda: c.init_tables([spec]), grpc.StatusCode.FAILED_PRECONDITION)
        assert not shard.shard.tables.tables  # nothing declared


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return reply.read().decode()


def test_checkpoint_round_trip_status_and_metrics(tmp_path, start_cluster, tool) -> None:
    (shard,) = start_cluster(num_shards=1, num_workers=1, mode="async", checkpoint_dir=str(tmp_path))
    torch.manual_seed(0)
    model = Model()
    model.emb.ps_init = model.bag.ps_init = "declared"  # lazy rows: a shard stores only the rows pushed
    with PSClient([shard.address], rank=0, num_workers=1, timeout=RPC_TIMEOUT) as c:
        c.init(model, dict(OPTIMIZER))
        opt = DistributedOptimizer(model, c)
        for step in range(3):
            ids, bag, offsets, y = batch(step, 0)
            opt.zero_grad()
            F.mse_loss(model(ids, bag, offsets), y).backward()
            opt.step()
        before = c.pull_rows("emb.weight", torch.arange(1000))
    with grpc.insecure_channel(shard.address) as ch:
        ps_pb2_grpc.AdminStub(ch).Checkpoint(ps_pb2.CheckpointRequest(), timeout=RPC_TIMEOUT)
        status = ps_pb2_grpc.AdminStub(ch).GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT).status
    tables = {t.name: t for t in status.tables}
    touched = torch.unique(torch.cat([batch(s, 0)[0] for s in range(3)])).numel()
    assert tables["emb.weight"].rows == touched and tables["emb.weight"].dim == 4
    assert tables["emb.weight"].optimizer == "adagrad" and tables["emb.weight"].bytes > 0
    assert status.tables_version == 3
    text = scrape(f"http://127.0.0.1:{shard.metrics_endpoint.port}/metrics")
    assert f'ps_table_rows{{table="emb.weight"}} {float(touched)}' in text
    assert 'ps_table_received_bytes_total{table="bag.weight"}' in text
    assert 'ps_received_bytes_total{method="ps.v1.ParameterService/PushRows"}' in text
    lint = subprocess.run(
        [tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    shard.stop(grace=0.2)
    restarted = start_cluster.restart(shard)
    assert restarted.shard.tables.version == 3
    with PSClient([restarted.address], rank=0, num_workers=1, timeout=RPC_TIMEOUT) as c:
        torch.manual_seed(0)
        c.init(Model(), dict(OPTIMIZER))  # its weights' seed is refused (tables trained): the rows stay
        assert torch.equal(c.pull_rows("emb.weight", torch.arange(1000)), before)


def test_prefetch_pulls_every_table_in_one_call_per_shard(start_cluster) -> None:
    cluster = start_cluster(num_shards=2, num_workers=1, mode="async")
    torch.manual_seed(0)
    model = Model()
    with PSClient(cluster.addresses, rank=0, num_workers=1, timeout=RPC_TIMEOUT) as c:
        c.init(model, dict(OPTIMIZER))
        assert c.tables is not None
        ids, bag, offsets, _ = batch(0, 0)
        c.tables.declare()
        before = c.tables.calls["PullRows"]
        plain = model(ids, bag, offsets)
        assert c.tables.calls["PullRows"] - before == 4  # one per module and shard
        prefetch(c, {"emb.weight": ids, "bag.weight": bag})
        fetched = model(ids, bag, offsets)
        assert c.tables.calls["PullRows"] - before == 6  # one more per shard for both tables
        assert torch.equal(plain, fetched)


def test_pulls_split_over_messages_and_oversized_pushes_are_refused_before_sending(start_cluster) -> None:
    cluster = start_cluster(num_shards=2, num_workers=1, mode="async")
    c = PSClient(cluster.addresses, rank=0, num_workers=1, timeout=RPC_TIMEOUT, partition_bytes=4096)
    with c:
        c.join()
        c.init_tables([TableSpec("t", 10_000, 4, RowOptimizerSpec("sgd", {"lr": 1.0}))])
        ids = torch.arange(0, 10_000, 7)  # 1429 rows of 24 bytes (id + row): ~4 requests per shard
        assert torch.equal(c.pull_rows("t", ids), initial_rows("t", 0, 1.0, ids, 4))
        assert c.tables is not None and c.tables.calls["PullRows"] >= 6
        with pytest.raises(ValueError, match="nothing was pushed"):
            c.push_rows({"t": (ids, torch.ones(ids.numel(), 4))})
        assert c.tables.calls["PushRows"] == 0 and c.tables.clock == 0


# ----------------------------------------------------------------- bytes, declarers, lock time
def _table_proto(dim: int = 4, optimizer: str = "sgd", lr: float = 1.0) -> ps_pb2.TableSpec:
    return ps_pb2.TableSpec(
        name="t", num_rows=100, dim=dim, optimizer=ps_pb2.OptimizerSpec(name=optimizer, kwargs={"lr": lr})
    )


def test_only_a_joined_live_rank_0_declares_tables(start_cluster) -> None:
    (shard,) = start_cluster(num_shards=1, num_workers=1, mode="async")
    with grpc.insecure_channel(shard.address) as ch:
        stub = ps_pb2_grpc.ParameterServiceStub(ch)
        forged = ps_pb2.InitTablesRequest(rank=0, incarnation=2**62, tables=[_table_proto()])
        assert "not joined" in _refused(
            lambda: stub.InitTables(forged, timeout=RPC_TIMEOUT), grpc.StatusCode.FAILED_PRECONDITION
        )
        assert not shard.shard.tables.tables
        with PSClient([shard.address], rank=0, num_workers=1, timeout=RPC_TIMEOUT, retry_deadline=5) as c:
            c.join()
            later = ps_pb2.InitTablesRequest(rank=0, incarnation=c.session.incarnation + 1, tables=[_table_proto()])
            _refused(lambda: stub.InitTables(later, timeout=RPC_TIMEOUT), grpc.StatusCode.FAILED_PRECONDITION)
            assert not shard.shard.tables.tables
            c.init_tables([TableSpec("t", 100, 4, RowOptimizerSpec("sgd", {"lr": 1.0}))])
            assert list(shard.shard.tables.tables) == ["t"]


def test_tables_are_bounded_in_bytes_and_lr_as_dense(start_cluster) -> None:
    row = 4096 * 4 * 3 + 24  # one adam row of dim 4096
    (shard,) = start_cluster(num_shards=1, num_workers=1, mode="async", max_table_bytes=4 * row)
    with PSClient([shard.address], rank=0, num_workers=1, timeout=RPC_TIMEOUT, retry_deadline=5) as c:
        c.join()
        with grpc.insecure_channel(shard.address) as ch:
            stub = ps_pb2_grpc.ParameterServiceStub(ch)
            huge_lr = ps_pb2.InitTablesRequest(
                rank=0, incarnation=c.session.incarnation, tables=[_table_proto(optimizer="adam", lr=1e308)]
            )
            assert "float32" in _refused(
                lambda: stub.InitTables(huge_lr, timeout=RPC_TIMEOUT), grpc.StatusCode.INVALID_ARGUMENT
            )
            too_wide = ps_pb2.InitTablesRequest(
                rank=0, incarnation=c.session.incarnation, tables=[_table_proto(dim=65536, optimizer="adam")]
            )
            assert "--max-table-bytes" in _refused(
                lambda: stub.InitTables(too_wide, timeout=RPC_TIMEOUT), grpc.StatusCode.RESOURCE_EXHAUSTED
            )
        c.init_tables([TableSpec("t", 100, 4096, RowOptimizerSpec("adam", {"lr": 0.01}))])
        c.push_rows({"t": (torch.tensor([1]), torch.ones(1, 4096))})
        t = shard.shard.tables.tables["t"]
        assert t.capacity == 1 and t.num_bytes == row  # one row asked, one row allocated
        assert "max-table-bytes" in _refused(
            lambda: c.push_rows({"t": (torch.arange(2, 7), torch.ones(5, 4096))}), grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert t.rows == 1 and shard.shard.tables.version == 1  # nothing changed
        c.push_rows({"t": (torch.arange(2, 5), torch.ones(3, 4096))})
        assert t.rows == 4 and shard.shard.tables.num_bytes <= 4 * row


def test_a_large_pull_answers_one_version_while_pushes_apply_between_its_chunks(start_cluster) -> None:
    """Every row of the pull moves by +1 per push: a consistent answer has one offset for all rows,
    the number of pushes before the version it names."""
    (shard,) = start_cluster(num_shards=1, num_workers=1, mode="async")
    n = 300_000  # several chunks of READ_CHUNK_IDS
    ids = torch.arange(n)
    with _joined([shard.address], num_rows=n, dim=1) as c:
        c.push_rows({"t": (ids, -torch.ones(n, 1))})  # every row held, at version 1
        initial = initial_rows("t", 7, 1.0, ids, 1)
        stop = threading.Event()
        errors: list[BaseException] = []

        def pusher() -> None:
            try:
                for _ in range(200):
                    if stop.is_set():
                        return
                    c.push_rows({"t": (ids, -torch.ones(n, 1))})
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        with grpc.insecure_channel(shard.address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
            stub = ps_pb2_grpc.ParameterServiceStub(ch)
            request = ps_pb2.PullRowsRequest(
                rank=0,
                incarnation=c.session.incarnation,
                blocks=[ps_pb2.RowBlock(table="t", ids=ids.numpy().tobytes())],
            )
            thread = threading.Thread(target=pusher)
            thread.start()
            try:
                versions = set()
                for _ in range(6):
                    reply = stub.PullRows(request, timeout=RPC_TIMEOUT)
                    rows = torch.frombuffer(bytearray(reply.blocks[0].data), dtype=torch.float32).reshape(n, 1)
                    offset = rows - initial
                    assert torch.allclose(offset, torch.full_like(offset, float(reply.version)), atol=1e-3), (
                        reply.version
                    )
                    versions.add(reply.version)
            finally:
                stop.set()
                thread.join(timeout=60)
        assert not errors, errors
        assert not thread.is_alive()
