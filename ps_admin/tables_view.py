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


def table_lines(results: Sequence[ShardResult]) -> list[str]:
    """``table emb.weight 10000000x64 adagrad: 12345 rows held (shard 0: 6100, shard 1: 6245), 6.1 MiB,
    pulled 51200, pushed 51200 rows, cap 50000000/shard``, one line per table; none without tables."""
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
            f"pushed {sum(t.rows_pushed for _, t in parts)} rows, cap {first.max_rows}/shard"
        )
    return lines
