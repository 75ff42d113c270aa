"""Embedding rows fetched ahead: batch i+1's rows travel while batch i trains.

A model with shard-served tables (``ps_worker.tables.modules``) pulls its batch's rows in the
forward, one ``PullRows`` per module and shard, and the forward waits for them. With the next
batch known a step ahead (the pipelined embedding lookups of TorchRec's
``TrainPipelineSparseDist``, Persia and XDL), the pull leaves as soon as this step's row gradients
are pushed, on a thread of its own, while the dense ``PushPull`` of the step runs:

1. :class:`RowPrefetcher` wraps the ``DataLoader``: it reads one batch ahead and, before it yields
   batch i, tells the tables which rows batch i+1 looks up (``table_inputs(batch)``: table module
   or table name -> int64 ids).
2. ``DistributedOptimizer.step()`` of batch i pushes the row gradients on that thread and then
   pulls batch i+1's rows (:meth:`Ahead.after_push`) while the dense step runs on the calling
   thread; the step returns once the push is answered (its errors are the step's), not the pull.
3. Batch i+1's forward takes the rows from the pull (:meth:`Ahead.take`; it waits if they are
   still on their way); a module whose input's distinct ids differ from the prefetched ones pulls
   them itself, as without a prefetcher.

What the rows are:

- **sync**: the pull asks for table version t+1 after this rank's push of round t, and the shard
  answers once round t is closed and applied: exactly the rows a pull in batch i+1's forward reads
  (every rank's pushes of round t merged). Runs with and without a prefetcher are bitwise equal.
- **async, ssp**: the rows as the shard holds them when the pull arrives, just after this rank's
  push was applied: this rank's own update is in; other ranks' updates that land during this
  rank's dense step and the next batch's data loading are not, which a pull in the forward would
  have read. Reads are at most one step older than without the prefetcher.
- A batch read while no step is between it and the last pull (the second batch of gradient
  accumulation, the first of an epoch) is pulled at once, when the prefetcher yields it: no rows
  change before the next push.

Resources: one thread for the prefetch job and ``num_shards`` threads for its calls (created on
first use, stopped with the client), and one batch's rows in memory beyond the current one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent import futures
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

log = logging.getLogger(__name__)

B = TypeVar("B")

TableInputs = Mapping[Any, torch.Tensor]
"""Table module (or table name, ``"emb.weight"``) -> the int64 ids its next forward looks up."""


EachShard = Callable[[Callable[[int], Any]], list[Any]]
"""Runs ``fn(shard)`` for every shard in parallel; returns the results in shard order."""


class Rows(Protocol):
    """What prefetching reads through (:class:`~ps_worker.tables.client.TableClient`)."""

    ahead: Ahead

    @property
    def specs(self) -> Mapping[str, Any]:
        """Table name -> its ``TableSpec``."""

    @property
    def num_shards(self) -> int: ...

    def pull_floor(self) -> int: ...

    def pull(
        self, requests: Mapping[str, torch.Tensor], min_version: int | None = None, each_shard: EachShard | None = None
    ) -> dict[str, torch.Tensor]: ...


class Ahead:
    """The prefetch state of one :class:`~ps_worker.tables.client.TableClient`: the ids the next
    batch looks up, and the pull of rows in flight.

    Args:
        tables: the client's tables; their calls run on this object's threads.
    """

    def __init__(self, tables: Rows) -> None:
        self.tables = tables
        self.next_ids: dict[str, torch.Tensor] | None = None
        """table -> distinct int64 ids [n] the batch after the current one looks up (set by
        :class:`RowPrefetcher`), pulled after the next push."""
        self._rows: futures.Future[dict[str, torch.Tensor] | None] | None = None
        self._ids: dict[str, torch.Tensor] = {}
        self._job: futures.ThreadPoolExecutor | None = None
        self._calls: futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.hits = 0
        """Forwards that used prefetched rows."""
        self.misses = 0
        """Forwards of a table with prefetched rows whose ids differed (they pulled their own)."""

    def _pools(self) -> tuple[futures.ThreadPoolExecutor, futures.ThreadPoolExecutor]:
        with self._lock:
            if self._job is None or self._calls is None:
                n = self.tables.num_shards
                self._job = futures.ThreadPoolExecutor(1, thread_name_prefix="ps-prefetch")
                self._calls = futures.ThreadPoolExecutor(n, thread_name_prefix="ps-prefetch-shard")
            return self._job, self._calls

    def each_shard(self, fn: Callable[[int], Any]) -> list[Any]:
        """:data:`EachShard` on this object's threads (beside the transport's, which the dense step uses)."""
        _, calls = self._pools()
        pending = [calls.submit(fn, k) for k in range(self.tables.num_shards)]
        futures.wait(pending)
        return [f.result() for f in pending]

    @property
    def pending(self) -> bool:
        """Whether rows are prefetched (or on their way) for the next forward."""
        return self._rows is not None

    def pull_now(self, ids: Mapping[str, torch.Tensor]) -> None:
        """Pull ``ids``' rows on the prefetch thread now, at the table version a pull would read now."""
        job, _ = self._pools()
        floor = self.tables.pull_floor()
        self._ids = dict(ids)
        self._rows = job.submit(self.tables.pull, self._ids, floor, self.each_shard)

    def push_then_pull(self, push: Callable[[EachShard], int]) -> futures.Future[int]:
        """Run ``push`` (given the shard fan-out to use) on the prefetch thread, then pull
        :attr:`next_ids`' rows at the version after it (sync: the round it joined, once closed).

        Returns:
            The push's future (its result: the table version it answered; its exception: the
            push's); the rows are :meth:`take`'s.
        """
        job, _ = self._pools()
        ids, self.next_ids = self.next_ids or {}, None
        self._ids = dict(ids)
        pushed: futures.Future[int] = futures.Future()

        def run() -> dict[str, torch.Tensor] | None:
            try:
                pushed.set_result(push(self.each_shard))
            except BaseException as exc:  # the step raises it; no rows of a version nobody made
                pushed.set_exception(exc)
                return None
            return self.tables.pull(ids, self.tables.pull_floor(), self.each_shard)

        self._rows = job.submit(run)
        return pushed

    def take(self, table: str, unique: torch.Tensor) -> torch.Tensor | None:
        """The prefetched rows of ``table`` for the distinct ids ``unique`` (int64 [n], ascending),
        float32 [n, dim]; None when none were prefetched or the ids differ.

        Raises:
            ShardError: the prefetching pull failed (as ``TableClient.pull``).
        """
        if self._rows is None or table not in self._ids:
            return None
        try:
            rows = self._rows.result()  # waits for the pull in flight
        except BaseException:
            self.drop()
            raise
        if rows is None:  # the push before it failed
            self.drop()
            return None
        want = self._ids.pop(table)
        got = rows.pop(table, None)
        if not self._ids:
            self._rows = None
        if got is None or not torch.equal(want, unique):
            self.misses += 1
            if self.misses == 1:
                log.warning(
                    "the rows prefetched for table %s are not the ids its forward looks up (%d prefetched, %d "
                    "looked up): it pulled them itself. Check the prefetcher's table_inputs.",
                    table,
                    want.numel(),
                    unique.numel(),
                )
            return None
        self.hits += 1
        return got

    def drop(self) -> None:
        """Forget the rows in flight (a step began: they are of the version before it)."""
        self._rows, self._ids = None, {}

    def close(self) -> None:
        """Stop the threads (a pull in flight ends with the channels)."""
        with self._lock:
            for pool in (self._job, self._calls):
                if pool is not None:
                    pool.shutdown(wait=False, cancel_futures=True)
            self._job = self._calls = None


class RowPrefetcher:
    """Prefetch every batch's embedding rows one step ahead (module docstring).

    Args:
        client: a ``PSClient`` whose model has shard-served tables (after ``client.init``).
        table_inputs: ``batch -> {table module or table name: int64 ids}``: the ids each table
            module's forward will look up for that batch (any shape; duplicates allowed), e.g.
            ``lambda batch: {model.emb: batch[0]}``. The ctr workload's DLRM has
            ``model.table_inputs(x)``.

    Raises:
        RuntimeError: the client has no tables.

    Example::

        prefetcher = RowPrefetcher(client, lambda batch: model.table_inputs(batch[0]))
        for x, y in prefetcher.wrap(loader):
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """

    def __init__(self, client: Any, table_inputs: Callable[[Any], TableInputs]) -> None:
        if client.tables is None:
            raise RuntimeError("No embedding tables: call client.init(model, ...) with a model that has some first.")
        self.tables: Rows = client.tables
        self.table_inputs = table_inputs

    def ids(self, batch: Any) -> dict[str, torch.Tensor]:
        """Table name -> distinct int64 ids [n] (ascending) ``batch`` looks up.

        Raises:
            KeyError: a key that is neither a table module nor a table name.
        """
        out: dict[str, torch.Tensor] = {}
        for key, ids in self.table_inputs(batch).items():
            name = getattr(key, "ps_table", None) if isinstance(key, nn.Module) else key
            if name not in self.tables.specs:
                raise KeyError(f"{key!r} is not a table of this client (tables: {sorted(self.tables.specs)}).")
            out[str(name)] = torch.unique(ids.detach().reshape(-1).cpu().to(torch.int64))
        return out

    def wrap(self, loader: Iterable[B]) -> Iterable[B]:
        """``loader``'s batches, in order, read one ahead; each batch's rows are prefetched."""
        return _Wrapped(self, loader)


class _Wrapped(Iterable[B]):
    def __init__(self, prefetcher: RowPrefetcher, loader: Iterable[B]) -> None:
        self.prefetcher, self.loader = prefetcher, loader

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[B]:
        ahead = self.prefetcher.tables.ahead
        it = iter(self.loader)
        try:
            current = next(it)
        except StopIteration:
            return
        current_ids = self.prefetcher.ids(current)
        for upcoming in it:
            if not ahead.pending:  # no step since the last pull: nothing changes before the next push
                ahead.pull_now(current_ids)
            current_ids = self.prefetcher.ids(upcoming)
            ahead.next_ids = current_ids
            yield current
            current = upcoming
        if not ahead.pending:
            ahead.pull_now(current_ids)
        ahead.next_ids = None
        yield current
