"""Admission, expiry and the LRU bound of embedding tables through a real shard: a row stored at its
k-th push, expired after T table steps by the shard's own timer, bytes kept under max_bytes, the
counts in GetStatus and Prometheus, bad specs refused at InitTables."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
import torch

from ps_common.tables import RowOptimizerSpec, TableSpec, initial_rows
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_server.tables.table import table_row_bytes
from ps_worker import PSClient

RPC_TIMEOUT = 20.0
SGD = RowOptimizerSpec("sgd", {"lr": 1.0})
BOUND_ROWS = 50


def _status(address: str) -> dict[str, ps_pb2.TableStatus]:
    with grpc.insecure_channel(address) as ch:
        status = ps_pb2_grpc.AdminStub(ch).GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT).status
    return {t.name: t for t in status.tables}


@pytest.mark.parametrize(
    "fields",
    [{"admit_after": 300}, {"on_full": "evict_lru"}, {"max_bytes": 16}, {"expire_after_seconds": -1.0}],
)
def test_bad_lifetime_specs_are_refused_and_declare_nothing(start_cluster, fields: dict) -> None:
    (shard,) = start_cluster(num_shards=1, num_workers=1, mode="async")
    with PSClient([shard.address], rank=0, num_workers=1, timeout=RPC_TIMEOUT, retry_deadline=5) as c:
        c.join()
        spec = ps_pb2.TableSpec(
            name="t", num_rows=100, dim=4, optimizer=ps_pb2.OptimizerSpec(name="sgd", kwargs={"lr": 1})
        )
        for k, v in fields.items():
            setattr(spec, k, v)
        request = ps_pb2.InitTablesRequest(rank=0, incarnation=c.session.incarnation, tables=[spec])
        with grpc.insecure_channel(shard.address) as ch, pytest.raises(grpc.RpcError) as err:
            ps_pb2_grpc.ParameterServiceStub(ch).InitTables(request, timeout=RPC_TIMEOUT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert not shard.shard.tables.tables


def test_admission_expiry_and_lru_through_a_shard(start_cluster) -> None:
    (shard,) = start_cluster(num_shards=1, num_workers=1, mode="async")
    adm = TableSpec("adm", 10**6, 4, SGD, seed=3, admit_after=3, expire_after_rounds=6)
    lru = TableSpec("lru", 10**6, 4, SGD, on_full="evict_lru", max_bytes=BOUND_ROWS * table_row_bytes(adm))
    with PSClient([shard.address], rank=0, num_workers=1, timeout=RPC_TIMEOUT, retry_deadline=5) as c:
        c.join()
        c.init_tables([adm, lru])
        x = torch.tensor([42])
        start = initial_rows("adm", 3, 1.0, x, 4)
        for _ in range(2):  # k - 1 pushes: dropped
            c.push_rows({"adm": (x, torch.ones(1, 4))})
        assert torch.equal(c.pull_rows("adm", x), start)
        c.push_rows({"adm": (x, torch.ones(1, 4))})  # the k-th: stored, this step applied
        assert torch.equal(c.pull_rows("adm", x), start - 1)
        for step in range(8):  # 8 steps without row 42, and more rows than the LRU table's bound
            ids = torch.arange(100 * step, 100 * step + 30)
            c.push_rows({"lru": (ids, torch.ones(30, 4))})
        deadline = time.monotonic() + 30  # the shard's timer evicts row 42 (expired after 6 steps)
        while _status(shard.address)["adm"].rows_evicted_expired == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        status = _status(shard.address)
        assert status["adm"].rows_evicted_expired == 1 and status["adm"].rows_admitted == 1
        assert status["adm"].admit_after == 3 and status["adm"].filter_bytes > 0
        assert torch.equal(c.pull_rows("adm", x), start)  # back to its initial value
        assert status["lru"].bytes <= lru.max_bytes and status["lru"].rows <= BOUND_ROWS
        assert status["lru"].rows_evicted_lru >= 8 * 30 - BOUND_ROWS and status["lru"].on_full == "evict_lru"
    url = f"http://127.0.0.1:{shard.metrics_endpoint.port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    assert 'ps_table_rows_admitted_total{table="adm"} 1.0' in text
    assert 'ps_table_rows_evicted_total{reason="expired",table="adm"} 1.0' in text
    assert 'ps_table_rows_evicted_total{reason="lru",table="adm"} 0.0' in text  # exported at 0
    assert f'ps_table_rows_evicted_total{{reason="lru",table="lru"}} {float(status["lru"].rows_evicted_lru)}' in text
