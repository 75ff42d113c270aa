"""``PSClient``: a worker's connection to every shard of a grpc-ps cluster (DESIGN section 9).

One channel per shard; pushes and pulls go to all shards in parallel, each as a stream of
partitions. Tensors may live on any device: device tensors are staged through pinned host memory
with ``non_blocking=True`` copies.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc
import torch

from ps_common import frames
from ps_common.channels import channel, parse_servers
from ps_common.codec import dtype_name, torch_dtype, wire_dtype_allowed
from ps_common.optimizer import OptimizerSpec
from ps_common.plan import DEFAULT_PARTITION_BYTES, ParameterSpec, PartitionSlice, Plan, make_plan
from ps_common.wire import (
    MODE_TO_NAME,
    NAME_TO_DTYPE,
    message_size,
    optimizer_from_proto,
    optimizer_to_proto,
    plan_to_proto,
    with_partition,
)
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_worker.compression import TopK
from ps_worker.errors import HINT_UNREACHABLE, ShardError, ShardUnreachableError
from ps_worker.retry import RETRYABLE, backoff_delays, retry_call

if TYPE_CHECKING:
    from ps_worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

MAX_RECOVERIES = 3
"""Recoveries (rejoin, re-init, resync) one call may go through before its error is raised."""

MESSAGE_OVERHEAD = 64 * 1024
"""Bytes allowed above ``partition_bytes`` for a message's header fields."""

SERVICE = "/ps.v1.ParameterService/"

WARN_UNREACHABLE_AFTER = 2.0
"""Seconds a shard may stay unreachable at Join before a warning names its address."""

JOIN_ATTEMPT_SECONDS = 5.0
"""Longest single Join attempt, seconds (Join answers in milliseconds; the rest is connecting)."""

WIRE_DTYPES = ("float32", "float16", "bfloat16")
"""Values of ``wire_dtype``: float16/bfloat16 halve the bytes of a float32 model."""


def reason_of(exc: grpc.RpcError) -> str:
    """The ``ps-reason`` a shard attached to a refusal ("" when none)."""
    try:
        metadata = exc.trailing_metadata() or ()
    except (AttributeError, ValueError):
        return ""
    return next((str(v) for key, v in metadata if key == "ps-reason"), "")


def model_specs(named: Sequence[tuple[str, torch.Tensor]]) -> list[ParameterSpec]:
    """Specs of ``model.named_parameters()``, in declaration order.

    Raises:
        InvalidRequestError: a dtype grpc-ps does not transport.
    """
    return [ParameterSpec(k, tuple(t.shape), dtype_name(t.dtype)) for k, t in named]


class PSClient:
    """A worker's handle on all shards.

    Args:
        servers: ``host:port`` of every shard, in shard-index order.
        rank: this worker's rank, ``0 <= rank < num_workers``.
        num_workers: ranks in the cluster.
        incarnation: grows each time this rank restarts; default: wall-clock microseconds, which
            grows across restarts without any stored state.
        token: bearer token for ParameterService (``PS_TOKEN``), or None.
        timeout: per-RPC deadline in seconds; a sync pull waits at most this long for its round.
        retry_deadline: seconds to keep retrying UNAVAILABLE (backoff with jitter).
        partition_bytes: largest partition payload in bytes (all workers must agree).
        tls_ca: PEM file of the CA of the shards' certificates: use TLS (DESIGN section 8).
        tls_cert: PEM client certificate for mutual TLS (with ``tls_key``).
        tls_key: PEM private key of ``tls_cert``.
        metrics: where to record push/pull seconds and bytes; None records nothing.
        wire_dtype: send gradients and receive weights as this dtype (float16/bfloat16: half the
            bytes of float32; the shards keep float32 weights and optimizer state and widen what
            they receive). None: each parameter's own dtype.
        topk: push only this fraction of each partition's gradient entries, the largest in
            magnitude, with error feedback (:class:`~ps_worker.compression.TopK`); 0: dense.

    Raises:
        ValueError: bad arguments.
    """

    def __init__(
        self,
        servers: Sequence[str],
        rank: int,
        num_workers: int,
        *,
        incarnation: int | None = None,
        token: str | None = None,
        timeout: float = 60.0,
        retry_deadline: float = 30.0,
        partition_bytes: int = DEFAULT_PARTITION_BYTES,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        metrics: WorkerMetrics | None = None,
        wire_dtype: str | None = None,
        topk: float = 0.0,
    ) -> None:
        servers = parse_servers(servers, "servers")
        if not 0 <= rank < num_workers:
            raise ValueError(f"rank must be in 0..{num_workers - 1}, got {rank}.")
        if wire_dtype not in (None, "", *WIRE_DTYPES):
            raise ValueError(f"wire_dtype must be one of {', '.join(WIRE_DTYPES)}, got {wire_dtype!r}.")
        self.wire_dtype = wire_dtype or None
        self.compressor = TopK(topk) if topk else None
        self.servers = list(servers)
        self.rank = rank
        self.num_workers = num_workers
        self.incarnation = time.time_ns() // 1000 if incarnation is None else incarnation
        self.timeout = timeout
        self.retry_deadline = retry_deadline
        self.partition_bytes = partition_bytes
        self.metrics = metrics
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        limit = partition_bytes + MESSAGE_OVERHEAD
        options = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # a restarted shard is back in seconds: reconnect within 1 s, not gRPC's default 120 s backoff
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self._channels = [channel(addr, options, tls_ca, tls_cert, tls_key) for addr in self.servers]
        self._stubs = [ps_pb2_grpc.ParameterServiceStub(ch) for ch in self._channels]
        # the data RPCs with pass-through (de)serializers: partitions travel as hand-built frames
        self._push_calls = [
            ch.stream_unary(SERVICE + "Push", response_deserializer=ps_pb2.PushResponse.FromString)
            for ch in self._channels
        ]
        self._pull_calls = [
            ch.unary_stream(SERVICE + "Pull", request_serializer=ps_pb2.PullRequest.SerializeToString)
            for ch in self._channels
        ]
        self._push_pull_calls = [ch.stream_stream(SERVICE + "PushPull") for ch in self._channels]
        # one message each way (a small model): a unary call, cheaper than a stream on both sides
        self._push_pull_once = [ch.unary_unary(SERVICE + "PushPullOnce") for ch in self._channels]
        self._exchange_calls = [ch.stream_stream(SERVICE + "Exchange") for ch in self._channels]
        self._pool = futures.ThreadPoolExecutor(max_workers=len(self.servers), thread_name_prefix="ps-client")
        self.plan: Plan | None = None
        self.mode = ""
        self.config = ps_pb2.ClusterConfig()
        self.lease_timeout = 10.0
        self.clock = 0
        self.exchanges = 0
        self.version = 0
        self.versions = [0] * len(self.servers)
        self.pushed_bytes = 0
        self.pulled_bytes = 0
        self.staleness: Counter[int] = Counter()
        self.recoveries: Counter[str] = Counter()
        self._pushed = [False] * len(self.servers)
        self._params: dict[str, torch.Tensor] = {}
        self._optimizer: OptimizerSpec | None = None
        self._last_push: list[list[frames.OutPartition]] | None = None
        self._owned: list[tuple[PartitionSlice, ...]] = []
        self._request_groups: list[list[list[int]]] | None = None
        self._single_response: list[bool] = []
        self.refused_pushes = 0
        self.dropped_pushes = 0
        # sent with every push (DistributedOptimizer sets them): per parameter group, the
        # hyperparameters of the step (an lr scheduler's values); skip: AMP found inf, skip the step
        self.step_hyperparameters: list[dict[str, float]] = []
        self.step_skip = False
        self.last_step_skipped = False  # the step of the last push_pull was skipped (any rank's skip)
        self._host: dict[str, torch.Tensor] = {}
        self._heartbeat_stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ helpers
    @property
    def num_shards(self) -> int:
        return len(self.servers)

    def _each_shard(self, fn: Callable[[int], Any]) -> list[Any]:
        """Run ``fn(shard_index)`` for every shard in parallel; once all are done, re-raise the first
        error in shard order."""
        if self.num_shards == 1:  # no hand-off to a pool thread (a third of a small step's time)
            return [fn(0)]
        pending = [self._pool.submit(fn, k) for k in range(self.num_shards)]
        futures.wait(pending)
        return [f.result() for f in pending]

    def _call(self, fn: Any, what: str) -> Any:
        return retry_call(fn, self.retry_deadline, what)

    def _with_recovery(self, k: int, fn: Callable[[], Any], what: str, repush: bool = True) -> Any:
        """``fn`` with retries of transient errors, and at most :data:`MAX_RECOVERIES` recoveries
        from refusals that name a fixable cause (see :meth:`_recover`; ``repush=False`` when ``fn``
        pushes again itself, as PushPull does)."""
        for attempt in range(MAX_RECOVERIES + 1):
            try:
                return self._call(fn, what)
            except grpc.RpcError as exc:
                if attempt == MAX_RECOVERIES or not self._recover(k, exc, repush):
                    raise ShardError.from_rpc(self.servers[k], exc, waits=not what.startswith("Push ")) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _recover(self, k: int, exc: grpc.RpcError, repush: bool = True) -> bool:
        """Bring shard ``k`` and this client back in step after a refusal; True when the call
        should be made again.

        - NOT_JOINED (evicted after a partition, or the shard restarted): Join again.
        - NOT_INITIALIZED (the shard restarted with no checkpoint): rank 0 writes its current
          values again (first writer wins); other ranks wait for that. Then Join.
        - FUTURE_ROUND (the shard restarted from an older checkpoint): adopt its round.
        - PUSH_LOST (the shard restarted and lost an acknowledged push of an open round): adopt
          its round and push the last gradient again.
        """
        reason = reason_of(exc)
        if reason not in ("NOT_JOINED", "NOT_INITIALIZED", "FUTURE_ROUND", "PUSH_LOST"):
            return False
        log.warning("rank %d: shard %s refused (%s: %s); recovering", self.rank, self.servers[k], reason, exc.details())
        self.recoveries[reason] += 1
        if reason == "NOT_INITIALIZED":
            if self.rank == 0 and self._params and self._optimizer is not None:
                self._init_shard(k, self._params, self._optimizer)
            else:
                self._wait_initialized({k: self._join_shard(k)}, self.retry_deadline)
        reply = self._join_shard(k)
        self.versions[k] = reply.version
        self._pushed[k] = False
        if reason == "PUSH_LOST" and repush and self._last_push is not None:
            self._push_shard(k, self._last_push[k])
        return True

    def _join_shard(self, k: int) -> ps_pb2.JoinResponse:
        """Join shard ``k``, retrying while it is unreachable (still starting, restarting) for at most
        ``retry_deadline`` seconds; after :data:`WARN_UNREACHABLE_AFTER` seconds a warning names the
        address.

        Raises:
            ShardUnreachableError: no answer within ``retry_deadline``. ShardError: a refusal.
        """
        req = ps_pb2.JoinRequest(rank=self.rank, num_workers=self.num_workers, incarnation=self.incarnation)
        start = time.monotonic()
        stop = start + self.retry_deadline
        delays = backoff_delays(base=0.1, cap=1.0)
        warned = False
        while True:
            # each attempt is short: a connection that hangs (a dropped SYN) must not use the whole budget
            attempt = max(0.1, min(self.timeout, stop - time.monotonic(), JOIN_ATTEMPT_SECONDS))
            try:
                return self._stubs[k].Join(req, timeout=attempt, metadata=self._metadata)
            except grpc.RpcError as exc:
                code = exc.code()
                if code not in RETRYABLE:
                    raise ShardError.from_rpc(self.servers[k], exc) from exc
                now = time.monotonic()
                if now >= stop:
                    raise ShardUnreachableError(
                        self.servers[k], code, exc.details() or "", self.retry_deadline
                    ) from exc
                if not warned and now - start >= WARN_UNREACHABLE_AFTER:
                    warned = True
                    log.warning(
                        "rank %d: shard %s not reachable yet (%s: %s); %s. Retrying for up to %g s (--retry-deadline).",
                        self.rank,
                        self.servers[k],
                        code.name,
                        exc.details(),
                        HINT_UNREACHABLE,
                        self.retry_deadline,
                    )
                time.sleep(max(0.0, min(next(delays), stop - now)))

    def _require_plan(self) -> Plan:
        if self.plan is None:
            raise RuntimeError("Call client.init(model, optimizer=...) before push or pull.")
        return self.plan

    # ------------------------------------------------------------------ membership and init
    def join(self) -> list[ps_pb2.JoinResponse]:
        """Join every shard (waiting up to ``retry_deadline`` for shards that are still starting).

        Raises:
            ShardUnreachableError: a shard did not answer within ``retry_deadline`` (its address is named).
            ShardError: a shard refused the join.
            RuntimeError: the shards disagree on mode or their indices do not match ``servers``.
        """
        replies = self._each_shard(self._join_shard)
        for k, r in enumerate(replies):
            if r.shard_index != k or r.num_shards != self.num_shards:
                raise RuntimeError(
                    f"{self.servers[k]} is shard {r.shard_index} of {r.num_shards}, but it is listed at "
                    f"position {k} of {self.num_shards}; list every shard in shard-index order."
                )
        modes = {r.config.mode for r in replies}
        if len(modes) != 1:
            raise RuntimeError(f"Shards disagree on the mode ({sorted(MODE_TO_NAME[m] for m in modes)}).")
        self.config = replies[0].config
        self.mode = MODE_TO_NAME[replies[0].config.mode]
        self.lease_timeout = replies[0].config.lease_timeout_seconds or 10.0
        if self.mode == "easgd":
            self.exchanges = max(r.clock for r in replies)
        else:
            self.clock = max(r.clock for r in replies)
        self._start_heartbeat()
        return replies

    def init(
        self,
        model: torch.nn.Module,
        optimizer: Mapping[str, Any] | None = None,
        *,
        init_timeout: float = 120.0,
        buffers: bool = True,
    ) -> None:
        """Join every shard; rank 0 writes the initial values and optimizer spec, every rank then
        pulls them into ``model`` so all ranks start from identical weights.

        Args:
            model: its ``named_parameters()`` define the plan (float32/float16/bfloat16/float64).
            optimizer: ``{"name": "sgd", "lr": 0.1, ...}`` (see ``ps_common.optimizer``);
                used by rank 0 only. Default ``{"name": "sgd", "lr": 0.1}``. Parameter groups:
                ``"groups": [{"params": ["fc.bias", ...], "weight_decay": 0.0}, ...]`` (parameter
                names), groups 1, 2...; group 0 holds the parameters in none, with the top-level arguments.
            init_timeout: seconds ranks other than 0 wait for rank 0's Init.
            buffers: the model's buffers (BatchNorm running statistics) join the plan, after the
                parameters, as untrained entries the shards set to rank 0's values each step
                (integer buffers travel as float64); :class:`DistributedOptimizer` loads them
                before each forward (DDP's ``broadcast_buffers``). Pushes and pulls then include
                them. False: parameters only.

        Raises:
            InvalidRequestError: a bad optimizer spec or unsupported parameter dtype.
            grpc.RpcError: FAILED_PRECONDITION on a plan mismatch, and other refusals.
            TimeoutError: rank 0 did not initialize the shards in time.
        """
        spec = dict(optimizer or {"name": "sgd", "lr": 0.1})
        groups = tuple(
            (tuple(str(key) for key in g["params"]), {k: float(v) for k, v in g.items() if k != "params"})
            for g in spec.pop("groups", ())
        )
        named = list(model.named_parameters())
        if buffers:
            named += [(k, b) for k, b in model.named_buffers() if b is not None]
        buffer_keys = tuple(k for k, _ in named[len(list(model.parameters())) :])
        opt = OptimizerSpec(str(spec.pop("name")), {k: float(v) for k, v in spec.items()}, groups, buffer_keys)
        unknown = sorted({k for keys, _ in groups for k in keys} - {k for k, _ in named})
        if unknown:
            raise ValueError(f"Optimizer groups name {unknown[:4]}, which are not parameters of the model.")
        self.plan = make_plan(
            model_specs([(k, t if t.is_floating_point() else t.to(torch.float64)) for k, t in named]),
            self.num_shards,
            self.partition_bytes,
        )
        self._owned_lengths = [
            {(p.key, p.offset): p.length for p in self.plan.owned_by(k)} for k in range(self.num_shards)
        ]
        self._wire_dtypes = {key: NAME_TO_DTYPE[name] for key, name in self.plan.dtypes.items()}
        if self.wire_dtype is not None:
            narrow = {key: wire_dtype_allowed(self.wire_dtype, name) for key, name in self.plan.dtypes.items()}
            if not all(narrow.values()):
                bad = sorted(key for key, ok in narrow.items() if not ok)
                raise ValueError(
                    f"wire_dtype {self.wire_dtype} is not narrower than parameters {bad[:4]}; "
                    "use it with float32 models, or leave it unset."
                )
        self._owned = [self.plan.owned_by(k) for k in range(self.num_shards)]
        self._request_groups = None
        self._single_response = [len(self._packing(k, sparse=False)) <= 1 for k in range(self.num_shards)]
        self._host = {}
        replies = self.join()
        if replies[0].HasField("optimizer"):  # already initialized (e.g. restored): its spec is the truth
            opt = optimizer_from_proto(replies[0].optimizer)
        self._params = {k: p for k, p in named}
        self._optimizer = opt
        if self.rank == 0:
            self._each_shard(lambda k: self._init_shard(k, self._params, opt))
        else:
            self._wait_initialized(dict(enumerate(replies)), init_timeout)
        params = {k: p.data if p.is_floating_point() else torch.empty(p.shape, dtype=torch.float64) for k, p in named}
        self.pull(params, min_version=0)
        for k, p in named:
            if not p.is_floating_point():  # an integer buffer, pulled as float64
                p.copy_(params[k])
        self.clock = max(self.clock, self.version) if self.mode == "sync" else self.clock

    def _init_shard(self, k: int, values: Mapping[str, torch.Tensor], opt: OptimizerSpec) -> None:
        """Init shard ``k`` with ``values`` (any device; copied to host memory once here)."""
        plan = self._require_plan()
        values = {key: t.detach().to("cpu", torch_dtype(plan.dtypes[key])) for key, t in values.items()}
        header = ps_pb2.InitHeader(
            rank=self.rank, incarnation=self.incarnation, plan=plan_to_proto(plan), optimizer=optimizer_to_proto(opt)
        )

        def stream() -> Iterator[ps_pb2.InitRequest]:
            yield self._sent(ps_pb2.InitRequest(header=header))
            for msg in self._partitions_of(k, values, ps_pb2.InitRequest):
                yield self._sent(msg)

        try:
            reply = self._call(
                lambda: self._stubs[k].Init(stream(), timeout=self.timeout, metadata=self._metadata),
                f"Init {self.servers[k]}",
            )
        except grpc.RpcError as exc:
            raise ShardError.from_rpc(self.servers[k], exc) from exc
        log.info("rank %d: shard %d init %s", self.rank, k, "applied" if reply.applied else "already done")

    def _wait_initialized(self, replies: Mapping[int, ps_pb2.JoinResponse], init_timeout: float) -> None:
        """Poll Join on the shards of ``replies`` (shard -> last reply) until rank 0 initialized them."""
        plan = self._require_plan()
        stop = time.monotonic() + init_timeout
        delays = backoff_delays(base=0.02, cap=0.5)
        for k, reply in replies.items():
            while not reply.initialized:
                if time.monotonic() > stop:
                    raise TimeoutError(
                        f"Shard {self.servers[k]} was not initialized within {init_timeout:.0f} s; is rank 0 running?"
                    )
                time.sleep(next(delays))
                req = ps_pb2.JoinRequest(rank=self.rank, num_workers=self.num_workers, incarnation=self.incarnation)
                reply = self._call(
                    lambda k=k, req=req: self._stubs[k].Join(req, timeout=self.timeout, metadata=self._metadata), "Join"
                )
            if reply.HasField("optimizer"):  # start from rank 0's spec, as the shards do
                self._optimizer = optimizer_from_proto(reply.optimizer)
            if reply.plan_digest != plan.digest:
                raise RuntimeError(
                    f"Shard {self.servers[k]} holds plan {reply.plan_digest[:12]} but this model's plan is "
                    f"{plan.digest[:12]}; every worker must build the same model."
                )

    # ------------------------------------------------------------------ heartbeats
    def _start_heartbeat(self) -> None:
        if self._heartbeat is None:
            self._heartbeat = threading.Thread(target=self._beat, name=f"ps-heartbeat-{self.rank}", daemon=True)
            self._heartbeat.start()

    def _beat(self) -> None:
        req = ps_pb2.HeartbeatRequest(rank=self.rank, incarnation=self.incarnation)
        while not self._heartbeat_stop.wait(self.lease_timeout / 3):
            for k, stub in enumerate(self._stubs):
                try:
                    stub.Heartbeat(req, timeout=max(1.0, self.lease_timeout / 3), metadata=self._metadata)
                except grpc.RpcError as exc:
                    log.debug("heartbeat to %s failed: %s", self.servers[k], exc.code())

    # ------------------------------------------------------------------ data path
    def _sent(self, msg: Any) -> Any:
        """Count ``msg`` (a protobuf message or a frame) in ``ps_worker_sent_bytes_total``."""
        if self.metrics is not None:
            self.metrics.sent_bytes.inc(len(msg) if isinstance(msg, bytes) else message_size(msg))
        return msg

    def _host_flat(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """A 1-D CPU tensor holding ``t``'s values (a view for CPU tensors, pinned staging otherwise)."""
        if t.device.type == "cpu":
            return t.detach().reshape(-1)
        buf = self._host.get(key)
        if buf is None or buf.numel() != t.numel() or buf.dtype != t.dtype:
            buf = torch.empty(t.numel(), dtype=t.dtype, pin_memory=torch.cuda.is_available())
            self._host[key] = buf
        buf.copy_(t.detach().reshape(-1), non_blocking=True)
        return buf

    def _partitions_of(self, k: int, flats: Mapping[str, torch.Tensor], cls: type[Any]) -> list[Any]:
        """One protobuf ``cls`` message (InitRequest) per partition of shard ``k``, exact values."""
        plan = self._require_plan()
        dtypes = self._wire_dtypes
        msgs = []
        for part in plan.owned_by(k):
            flat = flats[part.key].detach().reshape(-1)
            data = flat[part.offset : part.offset + part.length].contiguous().view(torch.uint8).numpy().tobytes()
            msgs.append(with_partition(cls(), part.key, part.offset, part.length, dtypes[part.key], data))
        return msgs

    def _out_partitions(self, k: int, flats: Mapping[str, torch.Tensor], compress: bool) -> list[frames.OutPartition]:
        """Shard ``k``'s partitions of ``flats`` as they go on the wire (see :meth:`_to_wire`)."""
        return [self._to_wire(part, flats[part.key], compress) for part in self._owned[k]]

    def _to_wire(self, part: PartitionSlice, flat: torch.Tensor, compress: bool) -> frames.OutPartition:
        """Partition ``part`` of ``flat`` (a parameter's 1-D CPU tensor) as it goes on the wire: a
        view of the tensor, a copy cast to ``wire_dtype``, or (``compress``: gradients only) its
        top-k entries, which updates the error-feedback memory (once per push: callers keep the
        result for retries)."""
        values = flat[part.offset : part.offset + part.length]
        wire = torch_dtype(self.wire_dtype) if self.wire_dtype else None
        if compress and self.compressor is not None:
            idx, top = self.compressor.compress((part.key, part.offset), values, wire)
            return frames.OutPartition(part.key, part.offset, part.length, top, idx)
        if wire is not None and values.dtype != wire:
            values = values.to(wire)
        return frames.OutPartition(part.key, part.offset, part.length, values)

    def _packing(self, k: int, sparse: bool) -> list[list[int]]:
        """How shard ``k``'s partitions pack into PushPull messages (:func:`frames.pack`): indices
        into its partitions, one list per message. ``sparse``: as top-k pushes them (values and
        uint32 indices); otherwise dense, as the shard packs its response (it runs the same
        function on the same sizes: one group means PushPullOnce)."""
        plan = self._require_plan()
        wire = torch_dtype(self.wire_dtype) if self.wire_dtype else None
        owned = self._owned[k]
        itemsizes = [(wire or torch_dtype(plan.dtypes[p.key])).itemsize for p in owned]
        topk = self.compressor.k if sparse and self.compressor is not None else None
        return frames.packing([(p.key, p.length) for p in owned], itemsizes, plan.partition_bytes, topk)

    def _stage(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        plan = self._require_plan()
        missing = [s.key for s in plan.specs if s.key not in tensors]
        if missing:
            raise KeyError(f"push/pull needs every parameter of the plan; missing {missing[:4]}")
        flats = {s.key: self._host_flat(s.key, tensors[s.key]) for s in plan.specs}
        if any(t.device.type == "cuda" for t in tensors.values()):
            torch.cuda.synchronize()
        return flats

    def _push_header(self, k: int) -> ps_pb2.PushHeader:
        # sync: the round is the version the gradient's parameters came from (per shard, so a
        # shard restored from an older checkpoint is followed); otherwise the step count
        return ps_pb2.PushHeader(
            rank=self.rank,
            incarnation=self.incarnation,
            clock=self.versions[k] if self.mode == "sync" else self.clock,
            version=self.versions[k],
            plan_digest=self._require_plan().digest,
            groups=[ps_pb2.GroupHyperparameters(values=h) for h in self.step_hyperparameters],
            skip=self.step_skip,
        )

    def _pull_targets(self, out: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(key -> 1-D CPU tensor written by the pull, key -> device tensor to copy it into after)."""
        plan = self._require_plan()
        device_out = {k: t for k, t in out.items() if t.device.type != "cpu"}
        flats = {
            s.key: (self._host_flat(s.key, out[s.key]) if s.key in device_out else out[s.key].data.reshape(-1))
            for s in plan.specs
        }
        if any(flat.data_ptr() != out[k].data_ptr() and k not in device_out for k, flat in flats.items()):
            raise ValueError("pull() writes in place and needs contiguous CPU tensors or device tensors.")
        return flats, device_out

    def _finish_pull(
        self, versions: list[int], device_out: Mapping[str, torch.Tensor], flats: Mapping[str, torch.Tensor]
    ) -> int:
        for key, t in device_out.items():
            t.copy_(flats[key].view(t.shape), non_blocking=True)
        if device_out:
            torch.cuda.synchronize()
        self.versions = versions
        self._pushed = [False] * self.num_shards
        self.version = min(self.versions)
        return self.version

    def _receive(
        self, k: int, replies: Iterator[bytes], into: Mapping[str, torch.Tensor]
    ) -> tuple[int, int, ps_pb2.PushResponse | None]:
        """Copy the partitions of shard ``k``'s frames into ``into`` (key -> 1-D tensor).

        Returns:
            (version, payload bytes received, the push's answer if a frame carried one).

        Raises:
            RuntimeError: a partition outside the plan, or not every partition of the shard.
        """
        dtypes = self._require_plan().dtypes
        owned = self._owned_lengths[k]
        version, received, seen, answer = 0, 0, 0, None
        for raw in replies:
            msg = frames.read(raw)
            version = msg.ints.get(1, 0)
            if 3 in msg.blobs:
                answer = ps_pb2.PushResponse.FromString(msg.blobs[3])
            for p in msg.partitions:
                if (
                    owned.get((p.key, p.offset)) != p.length
                    or len(p.indices)
                    or p.dtype not in (dtypes[p.key], self.wire_dtype)
                ):
                    raise RuntimeError(f"Shard {self.servers[k]} sent a partition outside the plan: {p.key}")
                into[p.key][p.offset : p.offset + p.length].copy_(frames.view(p))
                received, seen = received + len(p.data), seen + 1
            if self.metrics is not None:
                self.metrics.received_bytes.inc(len(raw))
        if seen != len(owned):
            raise RuntimeError(f"Shard {self.servers[k]} sent {seen} of {len(owned)} partitions.")
        return version, received, answer

    def _account_push(self, replies: Sequence[ps_pb2.PushResponse]) -> None:
        """Clock, dropped and staleness counters, and a live mode switch, after a push."""
        self.clock += 1
        self.last_step_skipped = any(r.skipped for r in replies)
        first = replies[0]
        if first.dropped:
            self.dropped_pushes += 1
        elif not first.duplicate and self.mode != "sync":
            self.staleness[int(first.staleness)] += 1
        if first.mode and MODE_TO_NAME.get(first.mode, self.mode) != self.mode:
            log.info("rank %d: the cluster switched from %s to %s", self.rank, self.mode, MODE_TO_NAME[first.mode])
            self.mode = MODE_TO_NAME[first.mode]

    def push(self, grads: Mapping[str, torch.Tensor]) -> list[ps_pb2.PushResponse]:
        """Send one gradient per parameter to every shard, stamped (rank, incarnation, clock);
        the clock then advances by one. Retries resend the same stamp, so nothing applies twice.

        Args:
            grads: key -> gradient with the parameter's shape and dtype (any device).

        Returns:
            Each shard's answer, in shard order.

        Raises:
            ShardError: INVALID_ARGUMENT, FAILED_PRECONDITION, ABORTED (too stale: pull, then
                push the next clock) and others after retries.
        """
        flats = self._stage(grads)
        outs = [self._out_partitions(k, flats, compress=True) for k in range(self.num_shards)]
        self._last_push = outs
        sent = [0] * self.num_shards

        def one(k: int) -> ps_pb2.PushResponse:
            reply, sent[k] = self._push_shard(k, outs[k])
            return reply

        start = time.perf_counter()
        try:
            replies = self._each_shard(one)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.ABORTED:  # too stale: the step is done, its gradient refused
                self.refused_pushes += 1
                self.clock += 1
            raise
        finally:
            self.pushed_bytes += sum(sent)
        if self.metrics is not None:
            self.metrics.push_duration.observe(time.perf_counter() - start)
        self._account_push(replies)
        return replies

    def _push_shard(self, k: int, outs: Sequence[frames.OutPartition]) -> tuple[ps_pb2.PushResponse, int]:
        """Push ``outs`` to shard ``k`` (a header message, then one frame per partition); returns its
        answer and the bytes sent."""

        def attempt() -> tuple[ps_pb2.PushResponse, int]:
            header = self._sent(ps_pb2.PushRequest(header=self._push_header(k)).SerializeToString())
            sent = [len(header)]
            # built as gRPC sends them (overlapping the shard's reading), one partition per message
            messages = itertools.chain([header], _frames_of([[o] for o in outs], b"", self._sent, sent, 0))
            reply = self._push_calls[k](messages, timeout=self.timeout, metadata=self._metadata)
            return reply, sent[0]

        result = self._with_recovery(k, attempt, f"Push {self.servers[k]}")
        self._pushed[k] = True
        return result

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
        plan = self._require_plan()

        def min_for(k: int) -> int:  # computed per attempt: a recovery may move this shard's round
            if min_version is not None:
                return min_version
            if self.mode == "sync":
                return self.versions[k] + 1 if self._pushed[k] else self.versions[k]
            return 0

        flats, device_out = self._pull_targets(out)
        wire = NAME_TO_DTYPE[self.wire_dtype] if self.wire_dtype else ps_pb2.DTYPE_UNSPECIFIED

        def one(k: int) -> tuple[int, int]:
            def attempt() -> tuple[int, int]:
                req = ps_pb2.PullRequest(
                    rank=self.rank,
                    incarnation=self.incarnation,
                    min_version=min_for(k),
                    plan_digest=plan.digest,
                    wire_dtype=wire,
                )
                replies = self._pull_calls[k](req, timeout=self.timeout, metadata=self._metadata)
                version, received, _ = self._receive(k, replies, flats)
                return version, received

            try:
                return self._with_recovery(k, attempt, f"Pull {self.servers[k]}")
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED:  # the round awaited was refused: no push of ours is held
                    self._pushed[k] = False
                raise

        start = time.perf_counter()
        results = self._each_shard(one)
        if self.metrics is not None:
            self.metrics.pull_duration.observe(time.perf_counter() - start)
        self.pulled_bytes += sum(r[1] for r in results)
        return self._finish_pull([r[0] for r in results], device_out, flats)

    def push_pull(self, grads: Mapping[str, torch.Tensor], out: Mapping[str, torch.Tensor]) -> int:
        """One training step's communication in one call per shard (PushPull): push ``grads`` as
        :meth:`push` does, then copy the parameters of the version the push lands in into ``out``
        (sync: the round's result; async, ssp: as :meth:`pull`). Small partitions travel packed, up
        to ``partition_bytes`` per message; a shard whose partitions fit in one message gets one
        unary PushPullOnce call.

        Args:
            grads: key -> gradient (any device).
            out: key -> parameter tensor written in place (any device); may be the parameters
                the gradients belong to.

        Returns:
            The lowest version among the shards.

        Raises:
            ShardError: as :meth:`push` and :meth:`pull`. A push refused as too stale
                (ABORTED) is counted in ``refused_pushes`` and followed by a plain :meth:`pull`.
        """
        step = self.begin_push_pull(out, stream=False)
        for key, t in self._stage(grads).items():
            step.ready(key, t)
        return step.finish()

    def begin_push_pull(self, out: Mapping[str, torch.Tensor], stream: bool = True) -> PendingPushPull:
        """Start a :meth:`push_pull` whose gradients arrive one parameter at a time, so pushes
        overlap the rest of the backward pass: every shard that takes more than one message gets its
        PushPull stream now, and each message goes out as soon as the gradients of its partitions
        are :meth:`PendingPushPull.ready` (in any order; backward finishes the last layers first).
        :meth:`PendingPushPull.finish` sends the rest (zeros for parameters without a gradient),
        copies the new weights into ``out`` and returns the version.

        Args:
            out: as in :meth:`push_pull`; written only in ``finish()``, after backward.
            stream: start the streams now (False: everything waits for ``finish()``).

        Raises:
            ValueError: ``out`` is not contiguous CPU tensors or device tensors.
        """
        return PendingPushPull(self, out, stream)

    def exchange(self, params: Mapping[str, torch.Tensor]) -> int:
        """EASGD exchange: send the parameters x, receive d = alpha (x - center), set x -= d in place.

        (Async EASGD, Zhang, Choromanska, LeCun 2015, Algorithm 1; with ``--easgd-sync`` the shard
        applies every live rank's exchange of the period together, eqs. 5-6.)

        Args:
            params: key -> parameter tensor (any device), updated in place.

        Returns:
            The lowest shard version (count of center updates) after the exchange.

        Raises:
            grpc.RpcError: FAILED_PRECONDITION when the cluster is not in easgd mode, and others.
        """
        plan = self._require_plan()
        flats = self._stage(params)
        header = ps_pb2.ExchangeRequest(
            header=ps_pb2.ExchangeHeader(
                rank=self.rank, incarnation=self.incarnation, clock=self.exchanges, plan_digest=plan.digest
            )
        ).SerializeToString()
        diffs: dict[str, torch.Tensor] = {s.key: torch.zeros_like(flats[s.key]) for s in plan.specs}

        def one(k: int) -> tuple[int, int, int]:
            msgs = [header, *(frames.build([o]) for o in self._out_partitions(k, flats, compress=False))]

            def attempt() -> tuple[int, int, int]:
                replies = self._exchange_calls[k](iter(msgs), timeout=self.timeout, metadata=self._metadata)
                version, received, _ = self._receive(k, replies, diffs)
                return version, sum(len(m) for m in msgs), received

            return self._with_recovery(k, attempt, f"Exchange {self.servers[k]}")

        results = self._each_shard(one)
        self.exchanges += 1
        self.pushed_bytes += sum(r[1] for r in results)
        self.pulled_bytes += sum(r[2] for r in results)
        with torch.no_grad():
            for key, t in params.items():
                t.sub_(diffs[key].view(t.shape).to(t.device, non_blocking=True))
        self.versions = [r[0] for r in results]
        self.version = min(self.versions)
        return self.version

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Leave every shard (best effort), stop heartbeats and close the channels. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._heartbeat_stop.set()
        req = ps_pb2.LeaveRequest(rank=self.rank, incarnation=self.incarnation)
        for k, stub in enumerate(self._stubs):
            try:
                stub.Leave(req, timeout=5.0, metadata=self._metadata)
            except grpc.RpcError as exc:
                log.info("leave %s: %s", self.servers[k], exc.code())
        for ch in self._channels:  # cancels calls still in flight (an interrupted step's round wait)
            ch.close()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5.0)
        self._pool.shutdown(wait=True)

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def from_env(
        cls, model: torch.nn.Module | None = None, optimizer: Mapping[str, Any] | None = None, **overrides: Any
    ) -> PSClient:
        """A client configured by the environment contract (``PS_SERVERS``, ``PS_RANK``, ``PS_NUM_WORKERS``,
        token, TLS, ``PS_WIRE_DTYPE``...: :data:`ps_worker.env.CONTRACT`), joined with ``model`` when given
        (``optimizer``: default from ``PS_OPTIMIZER``/``PS_LR``/``PS_MOMENTUM``); ``overrides`` are
        constructor arguments that win. Raises ``ps_worker.env.EnvError`` naming a missing or invalid variable."""
        from ps_worker.env import init_from_env

        return init_from_env(model, optimizer, client_class=cls, **overrides)


class PendingPushPull:
    """A :meth:`PSClient.push_pull` in progress; made by :meth:`PSClient.begin_push_pull`.

    Thread-safe: :meth:`ready` may be called from autograd hooks while gRPC threads send.
    """

    def __init__(self, client: PSClient, out: Mapping[str, torch.Tensor], stream: bool) -> None:
        client._require_plan()
        self.client = client
        self.out = out
        self.flats, self.device_out = client._pull_targets(out)
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._grads: dict[str, torch.Tensor] = {}
        self._ready: set[str] = set()
        self._outs: list[dict[int, frames.OutPartition]] = [{} for _ in range(client.num_shards)]
        self._by_key: dict[str, list[tuple[int, int]]] = {}
        for k, owned in enumerate(client._owned):
            for i, part in enumerate(owned):
                self._by_key.setdefault(part.key, []).append((k, i))
        self._wire = NAME_TO_DTYPE[client.wire_dtype] if client.wire_dtype else 0
        if client._request_groups is None:  # fixed by the plan, wire dtype and top-k ratio
            client._request_groups = [client._packing(k, sparse=True) or [[]] for k in range(client.num_shards)]
        self.groups = client._request_groups
        self.started: dict[int, Any] = {}
        self.sent = [0] * client.num_shards
        # started streams: the frames built as their gradients become ready, and the groups still to build
        self._streams: dict[int, _Stream] = {}
        self._heads: dict[int, bytes] = {}
        if stream:
            for k in range(client.num_shards):
                if not self._once(k):
                    self._streams[k] = _Stream(self._cond, list(self.groups[k]), client.timeout)
                    self._heads[k] = self._head(k)
                    self.started[k] = client._push_pull_calls[k](
                        self._streams[k].messages(), timeout=client.timeout, metadata=client._metadata
                    )

    # -------------------------------------------------------------- what goes on the wire
    def _once(self, k: int) -> bool:
        return len(self.groups[k]) == 1 and self.client._single_response[k]

    def _out(self, k: int, i: int) -> frames.OutPartition:
        """Shard ``k``'s partition ``i`` as it goes on the wire, made once (top-k updates its
        error-feedback memory once per step, however often the message is sent)."""
        with self._lock:
            return self._out_locked(k, i)

    def _out_locked(self, k: int, i: int) -> frames.OutPartition:
        made = self._outs[k].get(i)
        if made is None:
            part = self.client._owned[k][i]
            made = self._outs[k][i] = self.client._to_wire(part, self._grads[part.key], compress=True)
        return made

    def _group_ready(self, k: int, g: list[int]) -> bool:
        owned = self.client._owned[k]
        return all(owned[i].key in self._ready for i in g)

    def _head(self, k: int) -> bytes:
        """The header fields of shard ``k``'s first request message."""
        c = self.client
        return frames.bytes_field(1, c._push_header(k).SerializeToString()) + frames.uint_field(3, self._wire)

    def _messages(self, k: int) -> Iterator[bytes]:
        """Shard ``k``'s request messages, once every gradient is ready (a call made in ``finish()``);
        built as gRPC sends them."""
        work = [[self._out(k, i) for i in g] for g in self.groups[k]]
        return _frames_of(work, self._head(k), self.client._sent, self.sent, k)

    def _build_ready(self, key: str) -> None:
        """Build the frames of started streams whose partitions are now all ready (caller holds
        ``_lock``)."""
        for k, stream in self._streams.items():
            for g in [g for g in stream.unbuilt if self._group_ready(k, g)]:
                m = self.client._sent(frames.build((self._out_locked(k, i) for i in g), self._heads[k]))
                self._heads[k] = b""
                self.sent[k] += len(m)
                stream.add(g, m)

    # -------------------------------------------------------------- the caller's side
    def ready(self, key: str, grad: torch.Tensor) -> None:
        """The gradient of parameter ``key`` is final (any device; copied to host here if needed).
        Its partitions are cast or top-k selected, and the messages they complete are built,
        here in the caller's thread; gRPC's sending threads only hand the bytes over."""
        flat = grad.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.to("cpu")
        with self._lock:
            self._grads[key] = flat
            for k, i in self._by_key.get(key, ()):
                self._out_locked(k, i)
            self._ready.add(key)
            self._build_ready(key)

    def cancel(self) -> None:
        """Abandon this push: cancel the calls started during backward (a shard applies nothing of
        a cancelled call); nothing was accounted and the clock stays."""
        for stream in self._streams.values():
            stream.abort()
        for call in self.started.values():
            call.cancel()
        self.started.clear()

    def _attempt(self, k: int, started: Any | None) -> tuple[ps_pb2.PushResponse, int, int, int]:
        c = self.client
        self.sent[k] = 0 if started is None else self.sent[k]
        if started is not None:
            replies: Iterator[bytes] = started
        elif self._once(k):
            (only,) = self._messages(k)
            replies = iter([c._push_pull_once[k](only, timeout=c.timeout, metadata=c._metadata)])
        else:
            replies = c._push_pull_calls[k](self._messages(k), timeout=c.timeout, metadata=c._metadata)
        version, received, answer = c._receive(k, replies, self.flats)
        if answer is None:
            raise RuntimeError(f"Shard {c.servers[k]} answered PushPull without the push's answer.")
        return answer, version, self.sent[k], received

    def finish(self) -> int:
        """Send what is left (zeros for parameters without a gradient), wait for every shard,
        copy the new weights into ``out``.

        Returns:
            The lowest version among the shards.

        Raises:
            grpc.RpcError: as :meth:`PSClient.push_pull`.
        """
        c = self.client
        for s in c._require_plan().specs:
            if s.key not in self._grads:
                self.ready(s.key, torch.zeros(math.prod(s.shape), dtype=torch_dtype(s.dtype)))
        c._last_push = [[self._out(k, i) for i in range(len(c._owned[k]))] for k in range(c.num_shards)]
        for stream in self._streams.values():  # every frame is built: the streams may end
            stream.finish()

        def one(k: int) -> tuple[ps_pb2.PushResponse, int, int, int]:
            started = self.started.pop(k, None)
            if started is not None:
                try:
                    return self._attempt(k, started)
                except grpc.RpcError:
                    # a stream started during backward failed: the whole push again, with the
                    # same stamp (a shard that accepted it answers as for a duplicate), recovering
                    pass
            return c._with_recovery(k, lambda: self._attempt(k, None), f"PushPull {c.servers[k]}", repush=False)

        start = time.perf_counter()
        try:
            results = c._each_shard(one)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ABORTED:
                raise
            c.refused_pushes += 1  # too stale: the step is done, its gradient refused
            c.clock += 1
            log.info("rank %d: push refused as too stale (%s); pulling", c.rank, exc.details())
            return c.pull(self.out)
        finally:
            for stream in self._streams.values():
                stream.finish()
        if c.metrics is not None:
            c.metrics.push_duration.observe(time.perf_counter() - start)
        c.pushed_bytes += sum(r[2] for r in results)
        c.pulled_bytes += sum(r[3] for r in results)
        c._account_push([r[0] for r in results])
        return c._finish_pull([r[1] for r in results], self.device_out, self.flats)


def _frames_of(
    work: list[list[frames.OutPartition]], head: bytes, sent: Callable[[bytes], bytes], counts: list[int], k: int
) -> Iterator[bytes]:
    """Build and yield one message per group of ``work``, ``head`` leading the first. The
    generator runs in gRPC's sending thread and lets go of each group once built, so that thread
    never holds the last reference to a tensor: a thread that frees a tensor while it exits during
    interpreter shutdown aborts the process (seen with a thread-local of the shard's interceptor)."""
    while work:
        m = sent(frames.build(work.pop(0), head))
        head = b""
        counts[k] += len(m)
        yield m


class _Stream:
    """A started PushPull stream: the frames :meth:`PendingPushPull.ready` builds, handed to
    gRPC's sending thread as they come. Holds bytes and indices only, never tensors (see
    :func:`_frames_of`)."""

    def __init__(self, cond: threading.Condition, groups: list[list[int]], timeout: float) -> None:
        self.cond = cond
        self.unbuilt = groups
        self.built: list[bytes] = []
        self.finished = False
        self.aborted = False
        self.timeout = timeout

    def add(self, group: list[int], frame: bytes) -> None:
        with self.cond:
            self.unbuilt.remove(group)
            self.built.append(frame)
            self.cond.notify_all()

    def finish(self) -> None:
        with self.cond:
            self.finished = True
            self.cond.notify_all()

    def abort(self) -> None:
        """Fail the stream instead of ending it: the shard sees a cancelled call, never a push."""
        with self.cond:
            self.aborted = True
            self.cond.notify_all()

    def messages(self) -> Iterator[bytes]:
        # The stream ends only at finish() (the step), even when every frame went out during
        # backward: until then the push can still be abandoned (abort) and the shard applies nothing.
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.built or self.finished or self.aborted, timeout=self.timeout)
                if self.aborted:
                    raise RuntimeError("push abandoned before step()")
                if not self.built:
                    return  # finished; or finish() never came in time: end the stream (the call fails)
                m = self.built.pop(0)
            yield m
