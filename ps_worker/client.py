"""``PSClient``: a worker's connection to every shard of a grpc-ps cluster (``docs/architecture.md#9-worker-library``).

One channel per shard; pushes and pulls go to all shards in parallel, each as a stream of partitions.
Device tensors are staged through pinned host memory with ``non_blocking=True`` copies. A facade over
``transport`` (channels, fan-out, retries), ``session`` (rank, clock, versions; join, heartbeats,
recovery), ``staging``, ``encoding`` (frames, pure given the plan), ``calls`` and ``pushpull`` (the
data calls); construction from the environment (:mod:`ps_worker.env`), export (:mod:`ps_worker.export`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ps_common.channels import parse_servers
from ps_common.errors import reason_of
from ps_common.frames import MESSAGE_OVERHEAD_BYTES
from ps_common.modes import ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_common.plan import DEFAULT_PARTITION_BYTES, Plan
from ps_common.tables import TableSpec
from ps_proto.v1 import ps_pb2
from ps_worker import env, export, optim_wrap
from ps_worker.awaiting import DEFAULT_WAIT_TIMEOUT, PeerWaits
from ps_worker.compression import TopK
from ps_worker.consistency import WorkerMode
from ps_worker.planning import model_plan, model_specs
from ps_worker.redo import DEFAULT_REDO_BYTES
from ps_worker.session import Session
from ps_worker.session_view import SessionField
from ps_worker.staging import HostStaging
from ps_worker.tables.client import TableClient
from ps_worker.tables.modules import attach_tables, join_then_seed
from ps_worker.tables.state import table_state
from ps_worker.transport import exchange
from ps_worker.transport.calls import ShardCalls
from ps_worker.transport.encoding import WIRE_DTYPES, WireCodec
from ps_worker.transport.grpc_link import Transport
from ps_worker.transport.pushpull import PendingPushPull

if TYPE_CHECKING:
    from ps_worker.metrics import WorkerMetrics
    from ps_worker.torch_optim import Translation

__all__ = ["PSClient", "PendingPushPull", "init_from_env", "model_specs", "reason_of", "WIRE_DTYPES"]


class PSClient:
    """A worker's handle on all shards.

    Args:
        servers: ``host:port`` of every shard, in shard-index order.
        rank: this worker's rank, ``0 <= rank < num_workers``.
        num_workers: ranks in the cluster.
        incarnation: grows each time this rank restarts; default: wall-clock microseconds, which
            grows across restarts without any stored state.
        token: bearer token for ParameterService (``PS_TOKEN``), or None.
        timeout: per-RPC deadline in seconds: it bounds a call, not a slow peer (:mod:`ps_worker.awaiting`).
        wait_timeout: seconds a wait for other ranks alive may last (default 1800; None or 0: no
            bound); then :class:`~ps_common.errors.AwaitingRanksError`. A silent rank is evicted anyway.
        retry_deadline: seconds to keep retrying UNAVAILABLE (backoff with jitter).
        partition_bytes: largest partition payload in bytes (all workers must agree).
        tls_ca: PEM file of the CA of the shards' certificates: use TLS (``docs/architecture.md#8-security``).
        tls_cert, tls_key: PEM client certificate and its private key, for mutual TLS.
        metrics: where to record push/pull seconds and bytes; None records nothing.
        wire_dtype: gradients and weights on the wire as this dtype (float16/bfloat16: half of float32's
            bytes; the shards keep float32 weights and state and widen what they get). None: each parameter's.
        topk: push only this fraction of each partition's gradient entries, the largest in
            magnitude, with error feedback (:class:`~ps_worker.compression.TopK`); 0: dense.
        data_path: ``"tcp"`` (default): the shard's data connection when Join offers one (no TLS): dense
            pushes of several messages stream there, received into the weights; a one-message push goes as a
            whole PushPullOnce call (one round trip); ``"grpc"``: always gRPC (``ps_common.dataconn.DATA_PATHS``).
        redo_bytes: sync, the bound of the redo log in bytes: this rank's pushes of the rounds a shard with
            periodic checkpoints could lose, pushed again after its restart (:mod:`ps_worker.redo`).

    The session's state scripts and tools read (``mode``, ``clock``, ``version``, counters...) reads
    through the client, each a :class:`~ps_worker.session_view.SessionField` of ``client.session``;
    ``ps_worker``'s own modules use the parts directly: ``client.session``, ``client.transport``
    (its ``policy``: the one retry policy) and ``client.path`` (``ShardCalls``: the one push path).

    Raises:
        ValueError: bad arguments.
    """

    tables: TableClient | None = None
    """The model's embedding tables (``ps_worker.tables.modules``), set by :meth:`init` or :meth:`init_tables`."""
    translation: Translation | None = None
    """The torch optimizers :meth:`init` was given, translated (``ps_worker.torch_optim``)."""

    # the session's state, read (and, by tests and tools, written) through the client
    mode: SessionField[str] = SessionField()
    num_workers: SessionField[int] = SessionField()
    """The cluster's worker count: the one given, until shard 0 resizes the job."""
    config: SessionField[ps_pb2.ClusterConfig] = SessionField()
    settings: SessionField[ModeSettings | None] = SessionField()
    incarnation: SessionField[int] = SessionField()
    clock: SessionField[int] = SessionField()
    exchanges: SessionField[int] = SessionField()
    version: SessionField[int] = SessionField()
    versions: SessionField[list[int]] = SessionField()
    pushed_bytes: SessionField[int] = SessionField()
    pulled_bytes: SessionField[int] = SessionField()
    staleness: SessionField[Counter[int]] = SessionField()
    recoveries: SessionField[Counter[str]] = SessionField()
    refused_pushes: SessionField[int] = SessionField()
    dropped_pushes: SessionField[int] = SessionField()
    last_step_skipped: SessionField[bool] = SessionField()

    def __init__(
        self,
        servers: Sequence[str],
        rank: int,
        num_workers: int,
        *,
        incarnation: int | None = None,
        token: str | None = None,
        timeout: float = 60.0,
        retry_deadline: float = 120.0,
        wait_timeout: float | None = DEFAULT_WAIT_TIMEOUT,
        partition_bytes: int = DEFAULT_PARTITION_BYTES,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        metrics: WorkerMetrics | None = None,
        wire_dtype: str | None = None,
        topk: float = 0.0,
        data_path: str = "tcp",
        redo_bytes: int = DEFAULT_REDO_BYTES,
    ) -> None:
        servers = parse_servers(servers, "servers")
        if not 0 <= rank < num_workers:
            raise ValueError(f"rank must be in 0..{num_workers - 1}, got {rank}.")
        if wire_dtype not in (None, "", *WIRE_DTYPES):
            raise ValueError(f"wire_dtype must be one of {', '.join(WIRE_DTYPES)}, got {wire_dtype!r}.")
        waits = PeerWaits(rank, wait_timeout)  # checks wait_timeout
        self.wire_dtype = wire_dtype or None
        self.compressor = TopK(topk) if topk else None
        self.servers = list(servers)
        self.rank = rank
        self.timeout = timeout
        self.retry_deadline = retry_deadline
        self.partition_bytes = partition_bytes
        self.metrics = metrics
        self.transport = Transport(
            self.servers,
            partition_bytes,
            token=token,
            timeout=timeout,
            retry_deadline=retry_deadline,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            metrics=metrics,
            data_path=data_path,
        )
        incarnation = time.time_ns() // 1000 if incarnation is None else incarnation
        self.session = Session(self.transport, rank, num_workers, incarnation, redo_bytes)
        self.session.waits = waits
        self.staging = HostStaging()
        self.path = ShardCalls(self.transport, self.session, self.staging, metrics)
        self.on_close: list[Callable[[], None]] = []  # run by close() once it left (ps_worker.embedded)
        self._closed = False

    @classmethod
    def from_env(cls, model: torch.nn.Module | None = None, optimizer: Any = None, **overrides: Any) -> PSClient:
        """A client configured by the environment contract (:data:`ps_worker.env.CONTRACT`), joined
        and initialized with ``model`` when given (``optimizer``: as :meth:`init`'s; default from
        ``PS_OPTIMIZER``, ``PS_LR``, ``PS_MOMENTUM``); ``overrides`` are constructor arguments that win.

        Raises:
            ps_worker.env.EnvError: a variable is missing or invalid (the message names it).
        """
        return env.init_from_env(model, optimizer, client_class=cls, **overrides)

    @property
    def num_shards(self) -> int:
        return len(self.servers)

    @property
    def worker_mode(self) -> WorkerMode:
        """What a step does in the cluster's mode (:mod:`ps_worker.consistency`)."""
        return self.session.worker

    @property
    def optimizer_spec(self) -> OptimizerSpec | None:
        """The server optimizer's spec in force (rank 0's, as the shards hold it), once initialized."""
        return self.session.optimizer

    @property
    def plan(self) -> Plan | None:
        """The partition plan (None before :meth:`init`)."""
        return self.path.codec.plan if self.path.codec is not None else None

    # ------------------------------------------------------------------ membership and init
    def join(self) -> list[ps_pb2.JoinResponse]:
        """Join every shard, waiting up to ``retry_deadline`` for shards still starting (as
        :meth:`Session.join <ps_worker.session.Session.join>`, which names what it raises)."""
        return self.session.join()

    def init(
        self, model: torch.nn.Module, optimizer: Any = None, *, init_timeout: float = 120.0, buffers: bool = True
    ) -> None:
        """Join every shard; rank 0 writes the initial values, optimizer spec and any table rows to
        import (``ps_worker.model_file``), every rank then pulls them so all start from identical weights.

        Args:
            model: its ``named_parameters()`` define the plan (float32/float16/bfloat16/float64).
            optimizer: a ``torch.optim.Optimizer`` or a list (AdamW + SparseAdam for the tables),
                built from ``model`` before this call (:func:`ps_worker.torch_optim.translate`), or
                ``{"name": "sgd", "lr": 0.1, ...}`` (``ps_common.optimizer``; the default), with
                ``"groups": [{"params": ["fc.bias", ...], "weight_decay": 0.0}, ...]`` (parameter
                names), groups 1, 2...; group 0 holds the parameters in none. Rank 0's is used.
            init_timeout: seconds ranks other than 0 wait for rank 0's Init.
            buffers: the model's buffers (BatchNorm running statistics) join the plan, after the
                parameters, as untrained entries the shards set to rank 0's values each step
                (integer buffers travel as float64); :class:`DistributedOptimizer` loads them before
                each forward (DDP's ``broadcast_buffers``); pushes and pulls include them. False: none.

        Raises:
            InvalidRequestError: a bad optimizer spec or unsupported parameter dtype.
            ValueError: ``wire_dtype`` wider than a parameter; optimizer groups naming unknown keys;
                a torch optimizer the shards do not run (LBFGS), or a trained parameter in none.
            ShardError: a refusal (PlanMismatch: the shards hold another model's plan).
            TimeoutError: rank 0 did not initialize the shards in time.
        """
        self.translation, optimizer = optim_wrap.spec_of(env.warn_if_ddp(model), optimizer)
        optimizer = attach_tables(self, model, optimizer)  # sparse embeddings become shard tables
        named, opt, plan = model_plan(model, optimizer, buffers, self.num_shards, self.partition_bytes)
        codec, join = WireCodec(plan, self.wire_dtype, self.compressor), join_then_seed(self, self.join)
        self.path.initialize(named, codec, opt, join, init_timeout)
        self.session.worker.after_init(self.session)

    # ------------------------------------------------------------------ embedding tables (ps_worker.tables.modules)
    def init_tables(self, specs: Sequence[TableSpec]) -> TableClient:
        """Declare embedding tables without modules (rank 0 declares, the others wait for it);
        :meth:`init` does this for a model's sparse embeddings. Returns :attr:`tables`."""
        limit = self.partition_bytes + MESSAGE_OVERHEAD_BYTES
        self.tables = TableClient(self.transport, self.session, specs, self.metrics, limit)
        self.tables.declare()
        return self.tables

    def pull_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64 [n]) of ``table`` as float32 [n, dim]: one PullRows per shard owning
        any (sync: waits for this rank's table round). See :meth:`TableClient.pull`."""
        if self.tables is None:
            raise RuntimeError("No embedding tables: call init() with a model that has some, or init_tables().")
        return self.tables.pull({table: ids})[table]

    def push_rows(self, grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
        """One step's row gradients, table -> (int64 ids [n], float32 grads [n, dim]): see
        :meth:`TableClient.push`. Returns the table version (sync: the round joined)."""
        if self.tables is None:
            raise RuntimeError("No embedding tables: call init() with a model that has some, or init_tables().")
        return self.tables.push(grads)

    # ------------------------------------------------------------------ data path
    def push(
        self,
        grads: Mapping[str, torch.Tensor],
        hyperparameters: Sequence[Mapping[str, float]] | None = None,
        skip: bool = False,
    ) -> list[ps_pb2.PushResponse]:
        """Send one gradient per parameter to every shard, stamped (rank, incarnation, clock);
        the clock then advances by one. Retries resend the same stamp, so nothing applies twice.

        Args:
            grads: key -> gradient with the parameter's shape and dtype (any device).
            hyperparameters: per parameter group of the optimizer spec, the step's numeric
                values (an lr scheduler's ``lr``); None: the last push's (none before the first).
            skip: AMP found inf: the shards skip the step (sync: the whole round).

        Returns:
            Each shard's answer, in shard order.

        Raises:
            ShardError: InvalidRequest, PreconditionFailed, StalePush (ABORTED: pull, then push
                the next clock) and others after retries.
            KeyError: a parameter of the plan is missing from ``grads``.
        """
        return self.path.push(grads, hyperparameters, skip)

    def pull(self, out: Mapping[str, torch.Tensor], min_version: int | None = None) -> int:
        """Copy the current parameters into ``out`` (in place, any device).

        Args:
            out: key -> tensor of the parameter's shape and dtype, written in place.
            min_version: wait until every shard reaches this version; default: in sync mode each
                shard's round after this worker's last push to it, otherwise no wait.

        Returns:
            The lowest version among the shards.

        Raises:
            RoundTimeoutError: DEADLINE_EXCEEDED, the round did not complete within ``timeout``;
                ``.ranks`` are the ranks it waits for.
            ShardError: other refusals (a ``grpc.RpcError``: branch on ``.code()``).
        """
        return self.path.pull(out, min_version)

    def push_pull(
        self,
        grads: Mapping[str, torch.Tensor],
        out: Mapping[str, torch.Tensor],
        hyperparameters: Sequence[Mapping[str, float]] | None = None,
        skip: bool = False,
        samples: int | None = None,
    ) -> int:
        """One training step's communication in one call per shard (PushPull): push ``grads`` as
        :meth:`push` does, then copy the parameters of the version the push lands in into ``out``
        (sync: the round's result; async, ssp: as :meth:`pull`). Small partitions travel packed, up
        to ``partition_bytes`` per message; a shard whose partitions fit in one message gets one
        unary PushPullOnce call.

        Args:
            grads: key -> gradient (any device).
            out: key -> parameter tensor written in place (any device); may be the parameters
                the gradients belong to.
            hyperparameters, skip: as in :meth:`push`.
            samples: diloco: the samples an outer gradient stands for (FedAvg's weight); None: uncounted.

        Returns:
            The lowest version among the shards.

        Raises:
            ShardError: as :meth:`push` and :meth:`pull`. A push refused as too stale
                (ABORTED) is counted in ``refused_pushes`` and followed by a plain :meth:`pull`.
        """
        step = PendingPushPull(self.path, out, False, hyperparameters, skip, samples)
        for key, t in self.staging.stage(self.path.plan, grads).items():
            step.ready(key, t)
        return step.finish()

    def begin_push_pull(
        self,
        out: Mapping[str, torch.Tensor],
        stream: bool = True,
        hyperparameters: Sequence[Mapping[str, float]] | None = None,
        skip: bool = False,
    ) -> PendingPushPull:
        """Start a :meth:`push_pull` whose gradients arrive one parameter at a time, so pushes
        overlap the rest of the backward pass: every shard that takes more than one message gets its
        PushPull stream now, and each message goes out as soon as the gradients of its partitions
        are :meth:`PendingPushPull.ready` (in any order; backward finishes the last layers first).
        :meth:`PendingPushPull.finish` sends the rest (zeros for parameters without a gradient),
        copies the new weights into ``out`` and returns the version.

        Args:
            out: as in :meth:`push_pull`; written only in ``finish()``, after backward.
            stream: start the streams now (False: everything waits for ``finish()``).
            hyperparameters, skip: as in :meth:`push`.

        Raises:
            ValueError: ``out`` is not contiguous CPU tensors or device tensors.
        """
        return PendingPushPull(self.path, out, stream, hyperparameters, skip)

    def exchange(self, params: Mapping[str, torch.Tensor]) -> int:
        """EASGD exchange: send the parameters x, receive d = alpha (x - center), set x -= d in place.

        (Async EASGD, Zhang, Choromanska, LeCun 2015, Algorithm 1; with ``--easgd-sync`` the shard
        applies every live rank's exchange of the period together, eqs. 5-6.)

        Args:
            params: key -> parameter tensor (any device), updated in place.

        Returns:
            The lowest shard version (count of center updates) after the exchange.

        Raises:
            ShardError: PreconditionFailed when the cluster is not in easgd mode, and others.
        """
        return exchange.exchange(self.path, params)

    # ------------------------------------------------------------------ the whole model
    def state_dict(
        self, like: Mapping[str, torch.Tensor] | None = None, min_version: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Every parameter, buffer and table (a sparse embedding's ``weight``, ``ps_worker.tables.state``) of
        the job as full CPU tensors, for ``torch.save`` and ``model.load_state_dict`` (``ps_worker.export``).

        Raises:
            RuntimeError: not initialized. grpc.RpcError: a refused pull. ValueError: a table too large."""
        return {**export.state_dict(self, like, min_version), **table_state(self.tables, min_version)}

    def pull_into(self, model: torch.nn.Module, min_version: int | None = None) -> int:
        """Copy the shards' parameters and buffers into ``model`` in place; returns the version read
        (see :func:`ps_worker.export.pull_into`).

        Raises:
            KeyError, ValueError: ``model`` is another architecture. RuntimeError, grpc.RpcError: as
            :meth:`state_dict`.
        """
        return export.pull_into(self, model, min_version)

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Leave every shard (best effort), stop heartbeats, close the channels and join the
        client's threads (each at most a few seconds). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.session.close()
        for then in self.on_close:
            then()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def init_from_env(model: torch.nn.Module | None = None, optimizer: Any = None, **overrides: Any) -> PSClient:
    """:meth:`PSClient.from_env`, exported as ``ps_worker.init_from_env``; ``overrides`` may also name
    ``environ`` and ``client_class`` (see :func:`ps_worker.env.init_from_env`)."""
    return env.init_from_env(model, optimizer, **{"client_class": PSClient, **overrides})
