"""The worker side of embedding tables' wire: InitTables, PullRows and PushRows to every shard.

Rows are partitioned with ``ps_common.tables.shard_of`` (a fixed 64-bit mix of the id), so the
worker sends each id to the one shard that owns it. A pull asks for the distinct ids of a batch
only, one PullRows per shard that owns any of them (all tables of the request in it); a push
coalesces each table's row gradients (duplicate ids summed in a fixed order: stable sort by id,
then in order) and sends one PushRows per shard, to every shard in sync mode (an empty push still
counts the rank in the table round). Bytes on the wire: 8 bytes per distinct id each way plus
``dim * 4`` bytes per row each way, plus framing.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import torch

from ps_common.errors import FutureRoundError, NotJoinedError, PSError, VersionAheadError
from ps_common.frames import MESSAGE_OVERHEAD_BYTES
from ps_common.plan import DEFAULT_PARTITION_BYTES
from ps_common.tables import TableSpec, shard_of
from ps_common.wire import table_spec_from_proto, table_spec_to_proto
from ps_proto.v1 import ps_pb2
from ps_worker.errors import error_from_rpc
from ps_worker.redo import LostRoundsError
from ps_worker.tables.prefetch import Ahead
from ps_worker.tables.seed import Seeds, shard_requests

if TYPE_CHECKING:
    from ps_worker.session import Session
    from ps_worker.transport.grpc_link import Transport

log = logging.getLogger(__name__)

RETRY = frozenset({grpc.StatusCode.UNAVAILABLE})

FRAMING_BYTES = 64 * 1024
"""Bytes of a message kept for everything but ids and rows (as the shard's ``table_servicer``)."""


def coalesce_rows(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the rows of equal ids in a fixed order (stable sort by id, then ``index_add_`` in order).

    Args:
        ids: int64 [n]. grads: float32 [n, dim].

    Returns:
        (distinct ids int64 [u] ascending, summed grads float32 [u, dim]).
    """
    order = torch.sort(ids, stable=True).indices
    ids, grads = ids[order], grads[order]
    unique, inverse = torch.unique_consecutive(ids, return_inverse=True)
    if unique.numel() == ids.numel():
        return unique, grads
    out = torch.zeros(unique.numel(), grads.shape[1], dtype=grads.dtype)
    out.index_add_(0, inverse, grads)
    return unique, out


def _ids_bytes(ids: torch.Tensor) -> bytes:
    return ids.numpy().astype("<i8", copy=False).tobytes()


class TableClient:
    """Embedding tables of one worker, over the client's transport and session.

    Args:
        transport: the client's channels (one per shard) and retries.
        session: the client's rank, incarnation and mode.
        specs: the model's tables (rank 0's are declared; the shards' answer is the truth).
        metrics: ``ps_worker_sent_bytes_total``/``received`` counters, or None.
        max_message_bytes: the largest message the client's channels carry (``partition_bytes`` plus
            framing): a pull whose rows exceed it is split over several calls; a push is refused.

    Attributes:
        clock: the clock of this rank's next PushRows (sync: the table round); None before
            :meth:`declare`.
        sent_bytes, received_bytes: payload bytes of ids and rows this worker sent and received.
    """

    def __init__(
        self,
        transport: Transport,
        session: Session,
        specs: Sequence[TableSpec],
        metrics: Any = None,
        max_message_bytes: int = DEFAULT_PARTITION_BYTES + MESSAGE_OVERHEAD_BYTES,
    ) -> None:
        self.transport = transport
        self.max_message_bytes = max_message_bytes
        self.session = session
        self.specs: dict[str, TableSpec] = {s.name: s for s in specs}
        self.metrics = metrics
        self.clock: int | None = None
        self.sent_bytes = 0
        self.received_bytes = 0
        self.lookups: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        """(table, distinct ids, rows leaf) of each forward since the last push (``ps_worker.tables.modules``)."""
        self.prefetched: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """table -> (distinct ids, rows) pulled ahead by ``ps_worker.tables.modules.prefetch`` for the next forward."""
        self.ahead = Ahead(self)
        """The next batch's rows pulled while this step runs (``ps_worker.tables.prefetch``)."""
        self.calls: Counter[str] = Counter()  # by method (InitTables, PullRows, PushRows)
        self.weights: dict[str, weakref.ref[torch.Tensor]] = {}
        """Table name -> the weight its module held before ``attach_tables`` removed it (a user
        optimizer built before ``client.init`` still holds it: ``ps_worker.torch_optim``)."""
        self.closed = False  # True once close() ran (the client's channels are closed)
        self.matrices: list[str] = []
        """Tables whose module held a weight: ``model.state_dict()`` and ``client.state_dict()`` hold
        them (``ps_worker.tables.state``)."""
        self.seeds: Seeds = {}
        """Rows rank 0 stores at :meth:`declare` (a model file's: ``ps_worker.tables.seed``)."""
        self.hyperparameters: Callable[[], Mapping[str, float]] | None = None
        """What each PushRows carries when :meth:`push` is given none: the row optimizer's values
        an lr scheduler set (``DistributedOptimizer`` reads them from the user's optimizer)."""

    def close(self) -> None:
        """Stop the prefetch threads, if any (``PSClient.close`` calls it)."""
        self.closed = True
        self.ahead.close()

    def _send(self, k: int, method: str, request: Any) -> Any:
        """``method`` to shard ``k`` (the transport's retry policy; a sync table round's waits, too)."""
        stub, address = self.transport.stubs[k], self.transport.servers[k]

        def once() -> Any:
            try:
                return getattr(stub, method)(request, timeout=self.transport.timeout, metadata=self.transport.metadata)
            except grpc.RpcError as exc:
                raise error_from_rpc(address, exc, waits=method == "PullRows") from None

        return self.transport.policy.call(
            once, f"{method} to shard {k}", address=address, codes=RETRY, waits=self.session.waits
        )

    def _call(self, k: int, method: str, request: Any) -> Any:
        """:meth:`_send`, counted; on NOT_JOINED (the shard restarted) Join again, once, and call again.

        Raises:
            LostRoundsError: sync, the shard restarted behind table rounds this rank pushed (FUTURE_ROUND on
                a PushRows, VERSION_AHEAD on a PullRows): they are not pushed again. ShardError: any other refusal.
        """
        self.calls[method] += 1
        sent = request.ByteSize()
        self.sent_bytes += sent
        if self.metrics is not None:
            self.metrics.sent_bytes.inc(sent)
        try:
            try:
                reply = self._send(k, method, request)
            except NotJoinedError as exc:
                s = self.session
                with s.recovering:  # after a recovery of the step's in progress: the round it leaves
                    s.recover(k, exc, False, s.push_round())  # the lost dense rounds are pushed again
                if method == "PushRows":
                    request.session = s.sessions[k]
                reply = self._send(k, method, request)
        except (FutureRoundError, VersionAheadError) as exc:
            raise LostRoundsError(
                f"{self.transport.servers[k]}: shard {k} restarted behind table rounds this rank pushed; table "
                f"rounds are not pushed again: restart the job from the shards' checkpoints. ({exc.details()})"
            ) from None
        got = reply.ByteSize()
        self.received_bytes += got
        if self.metrics is not None:
            self.metrics.received_bytes.inc(got)
        return reply

    # ------------------------------------------------------------------ declare
    def declare(self) -> None:
        """InitTables on every shard: rank 0 declares (then sends :attr:`seeds`), the others wait for
        it; adopt the tables in force and the clock of this rank's next push (the largest any shard gives).

        Raises:
            ShardError: a refusal (PlanMismatch: the shards hold other tables).
        """
        request = ps_pb2.InitTablesRequest(
            rank=self.session.rank,
            incarnation=self.session.incarnation,
            tables=[table_spec_to_proto(s) for s in self.specs.values()],
        )
        replies = self.transport.each_shard(lambda k: self._call(k, "InitTables", request))
        self.specs = {t.name: table_spec_from_proto(t) for t in replies[0].tables}
        self.clock = max(r.clock for r in replies)
        if self.seeds and self.session.rank == 0:  # other ranks' seeds are ignored
            names = ", ".join(self.seeds)
            log.info("seeded %d rows of tables %s", self._send_seeds(request), names)
        self.seeds = {}

    def _send_seeds(self, request: ps_pb2.InitTablesRequest) -> int:
        """Rank 0: send :attr:`seeds` to every shard, one InitTables per chunk (the declaration
        ``request`` with the chunk's rows). Returns the rows sent.

        Raises:
            ValueError: rows of a table that are not float32 [len(ids), dim] (before any call).
            ShardError: a refusal (RESOURCE_EXHAUSTED: beyond a table's limits; INVALID_ARGUMENT: rows
                of another table shape). A shard whose tables have trained already (a restarted
                rank 0: FAILED_PRECONDITION) keeps its rows; the rest of its chunks are not sent.
        """
        seeds, budget = self.seeds, self.max_message_bytes - FRAMING_BYTES
        for name, (ids, rows) in seeds.items():
            if rows.shape != (ids.numel(), self.specs[name].dim) or rows.dtype != torch.float32:
                raise ValueError(f"Rows of table {name!r} must be float32 [{ids.numel()}, {self.specs[name].dim}].")

        def send(k: int) -> int:
            sent = 0
            for blocks in shard_requests(self.specs, seeds, self.num_shards, k, budget):
                chunk = ps_pb2.InitTablesRequest(rank=request.rank, incarnation=request.incarnation, rows=blocks)
                chunk.tables.extend(request.tables)
                if self._seed_call(k, chunk) is None:
                    return sent
                sent += sum(len(b.ids) // 8 for b in blocks)
            return sent

        return sum(self.transport.each_shard(send))

    def _seed_call(self, k: int, request: ps_pb2.InitTablesRequest) -> ps_pb2.InitTablesResponse | None:
        """One InitTables with seed rows; None where the shard's tables trained already (its rows stay)."""
        try:
            return self._call(k, "InitTables", request)
        except PSError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.warning("%s: %s; its table rows stay as they are", self.transport.servers[k], exc.details())
            return None

    def _ensure(self) -> int:
        if self.clock is None:
            self.declare()
        assert self.clock is not None
        return self.clock

    @property
    def num_shards(self) -> int:
        """The shards the rows are spread over."""
        return self.transport.num_shards

    # ------------------------------------------------------------------ pull
    def pull_floor(self) -> int:
        """The table version a pull issued now waits for (sync: the round of this rank's last push)."""
        return self.session.worker.table_pull_floor(self._ensure())

    def pull(
        self,
        requests: Mapping[str, torch.Tensor],
        min_version: int | None = None,
        each_shard: Callable[[Callable[[int], Any]], list[Any]] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Rows of each table's ``ids``: one PullRows per shard that owns any of them (several when
        its rows exceed one message: reads may be split, pushes may not).

        Args:
            requests: table name -> int64 ids [n] (any order; duplicates read once).
            min_version: the table version to read (None: :meth:`pull_floor`).
            each_shard: runs the per-shard calls (None: the transport's pool).

        Returns:
            table name -> float32 rows [n, dim], in ``ids``' order (CPU).

        Raises:
            KeyError: an unknown table. ShardError: a refusal (ids out of range: INVALID_ARGUMENT).
        """
        if min_version is None:
            min_version = self.pull_floor()
        n = self.transport.num_shards
        plan: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        per_shard: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(n)]
        for name, ids in requests.items():
            self.specs[name]  # noqa: B018  (KeyError for an unknown table, before any call)
            unique, inverse = torch.unique(ids.detach().cpu().reshape(-1).to(torch.int64), return_inverse=True)
            owner = shard_of(unique, n)
            plan[name] = (unique, inverse, owner)
            for k in range(n):
                mine = unique[owner == k]
                if mine.numel():
                    per_shard[k].append((name, mine))

        def pull_shard(k: int) -> dict[str, torch.Tensor]:
            got: dict[str, list[torch.Tensor]] = {}
            for chunk in self._chunks(per_shard[k]):  # one request, unless the rows exceed one message
                request = ps_pb2.PullRowsRequest(
                    rank=self.session.rank,
                    incarnation=self.session.incarnation,
                    min_version=min_version,
                    blocks=[ps_pb2.RowBlock(table=name, ids=_ids_bytes(ids)) for name, ids in chunk],
                )
                reply = self._call(k, "PullRows", request)
                if len(reply.blocks) != len(chunk):
                    raise RuntimeError(f"Shard {k} answered {len(reply.blocks)} row blocks for {len(chunk)} asked.")
                for (name, ids), block in zip(chunk, reply.blocks, strict=True):  # answered in the order asked
                    values = np.frombuffer(block.data, dtype="<f4").reshape(ids.numel(), self.specs[name].dim)
                    got.setdefault(name, []).append(torch.from_numpy(values.copy()))
            return {name: torch.cat(parts) for name, parts in got.items()}

        replies = (each_shard or self.transport.each_shard)(pull_shard)
        out: dict[str, torch.Tensor] = {}
        for name, (unique, inverse, owner) in plan.items():
            rows = torch.empty(unique.numel(), self.specs[name].dim, dtype=torch.float32)
            for k, reply in enumerate(replies):
                if name in reply:
                    rows[owner == k] = reply[name]
            out[name] = rows[inverse]
        return out

    def _chunks(self, items: Sequence[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
        """Split (table, ids) blocks into requests whose ids and answered rows fit in one message."""
        budget = self.max_message_bytes - FRAMING_BYTES
        chunks: list[list[tuple[str, torch.Tensor]]] = []
        current: list[tuple[str, torch.Tensor]] = []
        used = 0
        for name, ids in items:
            per_row = self.specs[name].row_bytes + 8
            while ids.numel():
                room = (budget - used) // per_row
                if room <= 0:
                    chunks.append(current)
                    current, used = [], 0
                    continue
                take, ids = ids[:room], ids[room:]
                current.append((name, take))
                used += take.numel() * per_row
        if current:
            chunks.append(current)
        return chunks

    # ------------------------------------------------------------------ push
    def push(
        self,
        grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        hyperparameters: Mapping[str, float] | None = None,
        each_shard: Callable[[Callable[[int], Any]], list[Any]] | None = None,
    ) -> int:
        """One step's row gradients: coalesced per table, one PushRows per shard (every shard in sync
        mode, empty where no row of it was touched), stamped (rank, incarnation, clock); the clock
        then advances. Retries resend the same stamp, so nothing applies twice.

        Args:
            grads: table name -> (int64 ids [n], float32 grads [n, dim]); duplicates allowed.
            hyperparameters: the row optimizer's values for this step and after (``{"lr": 0.01}``,
                names in ``ps_common.tables.ROW_HYPERPARAMETERS``); None: :attr:`hyperparameters`'
                values, or none (the values in force stay).
            each_shard: runs the per-shard calls (None: the transport's pool).

        Returns:
            The largest table version a shard answered (sync: the round joined).

        Raises:
            KeyError: an unknown table. ShardError: a refusal (INVALID_ARGUMENT: non-finite rows,
                ids out of range, bad hyperparameters; RESOURCE_EXHAUSTED: a table's cap;
                FAILED_PRECONDITION: a sync round's ranks sent different hyperparameters); the
                clock does not advance.
        """
        clock = self._ensure()
        if hyperparameters is None and self.hyperparameters is not None:
            hyperparameters = self.hyperparameters()
        hyper = {k: float(v) for k, v in (hyperparameters or {}).items()}
        bad = [k for k, v in hyper.items() if not math.isfinite(v)]
        if bad:
            raise ValueError(
                f"Row optimizer hyperparameter {bad[0]}={hyper[bad[0]]} is not finite; nothing was pushed."
            )
        n = self.transport.num_shards
        per_shard: list[list[ps_pb2.RowBlock]] = [[] for _ in range(n)]
        for name, (ids, g) in grads.items():
            spec = self.specs[name]
            ids = ids.detach().cpu().reshape(-1).to(torch.int64)
            g = g.detach().cpu().reshape(ids.numel(), spec.dim).to(torch.float32)
            unique, summed = coalesce_rows(ids, g)
            owner = shard_of(unique, n)
            for k in range(n):
                mask = owner == k
                if bool(mask.any()):
                    per_shard[k].append(
                        ps_pb2.RowBlock(
                            table=name,
                            ids=_ids_bytes(unique[mask]),
                            dtype=ps_pb2.DTYPE_FLOAT32,
                            data=summed[mask].contiguous().numpy().tobytes(),
                        )
                    )
        budget = self.max_message_bytes - FRAMING_BYTES
        for k, blocks in enumerate(per_shard):
            size = sum(len(b.ids) + len(b.data) for b in blocks)
            if size > budget:
                raise ValueError(
                    f"This step's row gradients for shard {k} are {size} bytes, more than one message carries "
                    f"({budget}); nothing was pushed. Touch fewer rows per step (a smaller batch), or raise the "
                    "client's partition_bytes (and the shards' --max-message-bytes)."
                )
        every_shard = self.session.worker.pushes_in_rounds  # each shard counts the rank in its table round

        def push_shard(k: int) -> ps_pb2.PushRowsResponse | None:
            if not per_shard[k] and not every_shard:
                return None
            request = ps_pb2.PushRowsRequest(
                rank=self.session.rank,
                incarnation=self.session.incarnation,
                clock=clock,
                blocks=per_shard[k],
                session=self.session.sessions[k],
                hyperparameters=hyper,
            )
            return self._call(k, "PushRows", request)

        replies = (each_shard or self.transport.each_shard)(push_shard)
        self.clock = clock + 1
        return max((r.version for r in replies if r is not None), default=0)
