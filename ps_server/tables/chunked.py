"""What a table knows of the pulls reading it in chunks (:class:`ps_server.tables.row_read.RowRead`)."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class ChunkedRead(Protocol):
    """A pull reading a :class:`~ps_server.tables.table.Table` in chunks, between which the shard's
    lock is free: the table tells it before a push overwrites rows it may still read."""

    def preserve(self, table: Any, slots: torch.Tensor, values: torch.Tensor) -> None:
        """``table`` is about to overwrite rows at ``slots`` (int64 [m]) whose values are ``values``
        (float32 [m, dim], a copy); called with the shard's lock held."""
