"""Embedding tables in GetStatus and Prometheus: rows held, memory, rows and bytes moved per table.

Read at status and scrape time from the shard's :class:`~ps_server.tables.store.TableStore` under
the shard's lock (no second copy of any number). Prometheus names (label ``table``: a model has a
few tables): ``ps_table_rows`` and ``ps_table_memory_bytes`` gauges, ``ps_table_rows_pulled_total``,
``ps_table_rows_pushed_total``, ``ps_table_sent_bytes_total`` (row values answered to pulls) and
``ps_table_received_bytes_total`` (ids and gradients of accepted pushes),
``ps_table_rows_admitted_total`` (rows stored: at their first push, or their ``admit_after``-th) and
``ps_table_rows_evicted_total{table,reason}`` (reason ``expired`` or ``lru``; both exported at 0 from
the table's declaration) counters, and ``ps_table_version`` (row updates applied; sync: table rounds
closed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ps_proto.v1 import ps_pb2
from ps_server.tables.store import TableStore

TableRow = tuple[str, int, int, int, int, int, int, int, int, int]
"""A table's (name, rows, bytes, rows pulled, rows pushed, bytes sent, bytes received, rows admitted,
rows expired, rows evicted as least recently used)."""

EVICTION_REASONS = ("expired", "lru")
"""Values of the ``reason`` label of ``ps_table_rows_evicted_total``."""


def table_rows(store: TableStore) -> tuple[list[TableRow], int]:
    """One :data:`TableRow` per table of ``store``, and its version (caller holds the shard's lock)."""
    rows = [
        (
            t.spec.name,
            t.rows,
            t.num_bytes,
            t.rows_pulled,
            t.rows_pushed,
            t.bytes_sent,
            t.bytes_received,
            t.life.admitted,
            *(t.life.evicted[r] for r in EVICTION_REASONS),
        )
        for t in store.tables.values()
    ]
    return rows, store.version


def table_status(store: TableStore) -> tuple[ps_pb2.TableStatus, ...]:
    """One TableStatus per table (caller holds the shard's lock)."""
    return tuple(
        ps_pb2.TableStatus(
            name=t.spec.name,
            num_rows=t.spec.num_rows,
            dim=t.spec.dim,
            rows=t.rows,
            bytes=t.num_bytes,
            rows_pulled=t.rows_pulled,
            rows_pushed=t.rows_pushed,
            max_rows=t.max_rows,
            optimizer=t.spec.optimizer.name,
            rows_admitted=t.life.admitted,
            rows_evicted_expired=t.life.evicted["expired"],
            rows_evicted_lru=t.life.evicted["lru"],
            admit_after=t.spec.admit_after,
            expire_after_rounds=t.spec.expire_after_rounds,
            expire_after_seconds=t.spec.expire_after_seconds,
            max_bytes=t.spec.max_bytes,
            on_full=t.spec.on_full,
            filter_bytes=t.life.filter_bytes,
        )
        for t in store.tables.values()
    )


class TableCollector(Collector):
    """The ``ps_table_*`` metrics of one shard, read at scrape time.

    Args:
        read: :func:`table_rows` of the shard's tables and their version, read under the shard's lock
            (``Shard.table_metrics``).
    """

    def __init__(self, read: Callable[[], tuple[list[TableRow], int]]) -> None:
        self._read = read

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # read at scrape time only (tables appear after InitTables)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        rows, version = self._read()
        families: list[GaugeMetricFamily | CounterMetricFamily] = [
            GaugeMetricFamily("ps_table_rows", "Rows of each embedding table this shard holds.", labels=["table"]),
            GaugeMetricFamily(
                "ps_table_memory_bytes",
                "Bytes of each table's rows and optimizer state on this shard.",
                labels=["table"],
            ),
            CounterMetricFamily("ps_table_rows_pulled", "Row ids read by PullRows.", labels=["table"]),
            CounterMetricFamily("ps_table_rows_pushed", "Rows updated by the row optimizer.", labels=["table"]),
            CounterMetricFamily("ps_table_sent_bytes", "Bytes of row values answered to PullRows.", labels=["table"]),
            CounterMetricFamily(
                "ps_table_received_bytes", "Bytes of ids and row gradients of accepted PushRows.", labels=["table"]
            ),
        ]
        admitted = CounterMetricFamily(
            "ps_table_rows_admitted", "Rows stored (at their first push, or their admit_after-th).", labels=["table"]
        )
        evicted = CounterMetricFamily(
            "ps_table_rows_evicted",
            "Rows evicted, by reason: expired (not pushed within the expiry window) or lru (room under max_bytes).",
            labels=["table", "reason"],
        )
        for name, *values in rows:
            for family, value in zip(families, values[:6], strict=True):
                family.add_metric([name], value)
            admitted.add_metric([name], values[6])
            for reason, value in zip(EVICTION_REASONS, values[7:], strict=True):
                evicted.add_metric([name, reason], value)
        yield from families
        yield admitted
        yield evicted
        yield GaugeMetricFamily(
            "ps_table_version", "Row updates applied to the tables (sync: table rounds closed).", value=version
        )
