"""``ps-admin status``/``top`` lines for embedding tables: one per table, summed over shards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ps_proto.v1 import ps_pb2

if TYPE_CHECKING:
    from ps_admin.client import ShardResult


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _lifetime(parts: Sequence[tuple[int, ps_pb2.TableStatus]]) -> str:
    """The admission and eviction part of a table's line ("" when the table has neither)."""
    first = parts[0][1]
    expiry = [f"{first.expire_after_rounds} rounds"] if first.expire_after_rounds else []
    expiry += [f"{first.expire_after_seconds:g} s"] if first.expire_after_seconds else []
    lru = first.on_full == "evict_lru"
    if first.admit_after < 2 and not expiry and not lru:
        return ""
    admitted = f"; admitted {sum(t.rows_admitted for _, t in parts)}"
    if first.admit_after >= 2:
        admitted += f" (after {first.admit_after} pushes)"
    expired = sum(t.rows_evicted_expired for _, t in parts)
    evicted = f", evicted {expired} expired" + (f" (after {' or '.join(expiry)})" if expiry else "")
    evicted += f", {sum(t.rows_evicted_lru for _, t in parts)} lru"
    if lru:
        evicted += f" (max {_bytes(first.max_bytes)}/shard)"
    filters = sum(t.filter_bytes for _, t in parts)
    return admitted + evicted + (f", filter {_bytes(filters)}" if filters else "")


def table_lines(results: Sequence[ShardResult]) -> list[str]:
    """``table emb.weight 10000000x64 adagrad: 12345 rows held (shard 0: 6100, shard 1: 6245), 6.1 MiB,
    pulled 51200, pushed 51200 rows, cap 50000000/shard``, one line per table; none without tables.
    A table with admission, expiry or an LRU bound adds ``; admitted 13000 (after 2 pushes), evicted
    500 expired (after 1000 rounds), 155 lru (max 1.0 GiB/shard), filter 1.0 MiB``."""
    per_table: dict[str, list[tuple[int, ps_pb2.TableStatus]]] = {}
    for r in results:
        if r.status is not None:
            for t in r.status.tables:
                per_table.setdefault(t.name, []).append((r.status.shard_index, t))
    lines = []
    for name, parts in per_table.items():
        first = parts[0][1]
        rows = sum(t.rows for _, t in parts)
        held = ", ".join(f"shard {k}: {t.rows}" for k, t in parts)
        lines.append(
            f"table {name} {first.num_rows}x{first.dim} {first.optimizer}: {rows} rows held ({held}), "
            f"{_bytes(sum(t.bytes for _, t in parts))}, pulled {sum(t.rows_pulled for _, t in parts)}, "
            f"pushed {sum(t.rows_pushed for _, t in parts)} rows, cap {first.max_rows}/shard{_lifetime(parts)}"
        )
    return lines
