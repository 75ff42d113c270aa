"""Embedding tables on the worker side: the sparse modules in a user's model, their wire calls, and
:class:`RowPrefetcher` (the next batch's rows pulled while the current one trains)."""

from ps_worker.tables.prefetch import RowPrefetcher

__all__ = ["RowPrefetcher"]
