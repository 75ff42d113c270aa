"""ps-admin's embedding-table lines (ps_admin.tables_view), summed over shards."""

from __future__ import annotations

from ps_admin.client import ShardResult
from ps_admin.tables_view import table_lines
from ps_proto.v1 import ps_pb2


def _shard(k: int, rows: int) -> ShardResult:
    table = ps_pb2.TableStatus(
        name="emb.weight",
        num_rows=10_000_000,
        dim=64,
        rows=rows,
        bytes=rows * 512,
        rows_pulled=rows * 2,
        rows_pushed=rows,
        max_rows=50_000_000,
        optimizer="adagrad",
    )
    return ShardResult(k, f"127.0.0.1:{5000 + k}", ps_pb2.ShardStatus(shard_index=k, num_shards=2, tables=[table]))


def test_one_line_per_table_summed_over_shards() -> None:
    (line,) = table_lines([_shard(0, 100), _shard(1, 300), ShardResult(2, "127.0.0.1:1")])
    assert line.startswith("table emb.weight 10000000x64 adagrad: 400 rows held (shard 0: 100, shard 1: 300)")
    assert "pulled 800, pushed 400 rows, cap 50000000/shard" in line and "200.0 KiB" in line


def test_no_tables_no_lines() -> None:
    assert table_lines([ShardResult(0, "a", ps_pb2.ShardStatus())]) == []


def test_admission_and_evictions_join_the_line_when_a_table_has_them() -> None:
    shards = [_shard(0, 100), _shard(1, 300)]
    for r in shards:
        (t,) = r.status.tables
        t.admit_after, t.expire_after_rounds, t.on_full, t.max_bytes = 2, 1000, "evict_lru", 1024**3
        t.rows_admitted, t.rows_evicted_expired, t.rows_evicted_lru, t.filter_bytes = 500, 20, 5, 1024**2
    (line,) = table_lines(shards)
    assert line.endswith(
        "; admitted 1000 (after 2 pushes), evicted 40 expired (after 1000 rounds), 10 lru (max 1.0 GiB/shard), "
        "filter 2.0 MiB"
    ), line
