"""The worker's data calls to every shard: Init, Push and Pull (PushPull: :mod:`.pushpull`; Exchange: :mod:`.exchange`).

:class:`ShardCalls` joins the parts of a client: it stages tensors (:mod:`ps_worker.staging`),
encodes them (:mod:`ps_worker.transport.encoding`), sends them to every shard in parallel with retries
(:mod:`ps_worker.transport.grpc_link`), recovers and accounts through the session (:mod:`ps_worker.session`),
and records times and bytes (:mod:`ps_worker.metrics`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

import grpc
import torch

from ps_common import frames, tracing
from ps_common.codec import torch_dtype
from ps_common.errors import InvalidRequestError
from ps_common.optimizer import OptimizerSpec
from ps_common.plan import Plan, plan_for_digest
from ps_common.wire import optimizer_from_proto
from ps_proto.v1 import ps_pb2
from ps_worker.errors import error_from_rpc
from ps_worker.session import Session
from ps_worker.staging import HostStaging
from ps_worker.transport.encoding import WireCodec
from ps_worker.transport.grpc_link import Transport

if TYPE_CHECKING:
    from ps_worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)
startup = logging.getLogger("ps_worker.startup")
R = TypeVar("R")


def is_stale(exc: BaseException) -> bool:
    """A push refused with ABORTED (docs/architecture.md#4-idempotence-and-errors: pull and push the next clock):
    :class:`~ps_common.errors.StalePushError`, :class:`~ps_common.errors.ReplayedPushError`,
    :class:`~ps_common.errors.UpdateRefusedError` or :class:`~ps_common.errors.NonFiniteUpdateError`."""
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.ABORTED


@dataclasses.dataclass
class Pushed:
    """One push of this rank, as it goes on the wire (whichever call carries it: Push or PushPull)."""

    outs: Sequence[list[frames.OutPartition]]
    """Per shard, its partitions (a PushPull's are made as its frames are sent)."""
    round: int | None
    """sync: the round it is stamped for (every shard, every attempt); None: the session's clock."""
    hyperparameters: list[dict[str, float]]
    skip: bool = False
    """AMP found inf: the shards skip the step (a push again carries it too)."""
    hold: bool = False
    """sync: the round is held for clipping (``ps_worker.clipping``); such a push is never redone."""
    samples: int | None = None
    """diloco: the samples the outer gradient stands for (None: not counted)."""


class ShardCalls:
    """Init, push, pull and exchange for one client.

    Args:
        transport: channels to the shards. session: rank, clock, versions, recoveries.
        staging: host buffers. metrics: where times are recorded, or None.
    """

    def __init__(
        self, transport: Transport, session: Session, staging: HostStaging, metrics: WorkerMetrics | None
    ) -> None:
        self.transport = transport
        self.session = session
        self.staging = staging
        self.metrics = metrics
        self.codec: WireCodec | None = None
        self.params: dict[str, torch.Tensor] = {}
        """The model's tensors, for rank 0 to write again to a shard that lost them."""
        self.rewrite_source: Callable[[], tuple[Mapping[str, torch.Tensor], int]] | None = None
        """What rank 0 writes to a shard that restarted empty instead: (values of some of
        :attr:`params`' keys, the version they are of) — diloco: theta_global at the outer round
        the ranks are in (:meth:`~ps_worker.local_sgd.LocalSteps.global_values`); None: the model's
        values at version 0 (sync redoes the rounds the shard lost)."""
        self.last: Pushed | None = None
        """The last push (pushed again to a shard that lost it: :meth:`_repush`)."""
        self.last_hyperparameters: list[dict[str, float]] = []
        """The hyperparameters of the last push (a push given none carries them)."""
        session.repush = self._repush
        session.redo = self.push_again

    def initialize(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        codec: WireCodec,
        optimizer: OptimizerSpec,
        join: Callable[[], list[ps_pb2.JoinResponse]],
        init_timeout: float,
    ) -> None:
        """Join with ``codec``'s plan; rank 0 writes ``named``'s values and ``optimizer`` to every shard
        (and again to a shard that lost them), the other ranks wait up to ``init_timeout`` seconds for
        rank 0's Init; every rank then pulls the values into ``named`` in place (integer buffers
        travel as float64). A shard already initialized (e.g. restored) keeps its optimizer spec.

        Raises:
            ShardError: a refusal (PlanMismatch: the shards hold another model's plan).
            TimeoutError: rank 0 did not initialize the shards in time.
        """
        self.codec = codec
        self.session.plan_digest = codec.plan.digest
        self.staging.reset()
        replies = join()
        assert self.session.settings is not None
        optimizer = self.session.worker.shard_optimizer(optimizer, self.session.settings)  # diloco: the outer one
        codec = self.follow_plan(codec, replies[0].plan_digest)
        if replies[0].HasField("optimizer"):  # already initialized: its spec is the truth
            optimizer = optimizer_from_proto(replies[0].optimizer)
        self.params = dict(named)
        self.session.optimizer = optimizer
        unlike_ddp = self.session.worker.unlike_ddp(optimizer, self.session.settings)
        if unlike_ddp and self.session.rank == 0:
            log.warning("%s", unlike_ddp)

        def write(k: int) -> None:  # rank 0: the model's values, with the spec in force
            assert self.session.optimizer is not None
            self.init_shard(k, self.params, self.session.optimizer)

        def rewrite(k: int) -> None:  # rank 0, to a shard that restarted empty
            values, version = self.rewrite_source() if self.rewrite_source is not None else ({}, 0)
            assert self.session.optimizer is not None
            self.init_shard(k, {**self.params, **values}, self.session.optimizer, version)

        if self.session.rank == 0:
            self.session.reinit = rewrite
            self.transport.each_shard(write)
            startup.debug("start-up: written the initial values to %d shards", self.transport.num_shards)
        else:
            self.session.wait_initialized(dict(enumerate(replies)), init_timeout)
            startup.debug("start-up: waited for rank 0's values (rank %d)", self.session.rank)
        values = {k: p.data if p.is_floating_point() else torch.empty(p.shape, dtype=torch.float64) for k, p in named}
        self.pull(values, min_version=0)
        for k, p in named:
            if not p.is_floating_point():  # an integer buffer, pulled as float64
                p.copy_(values[k])
        startup.debug("start-up: initialized (rank %d, version %d)", self.session.rank, self.session.version)

    def follow_plan(self, codec: WireCodec, digest: str) -> WireCodec:
        """``codec``, or one of the same model on the plan the shards already hold when that is the
        cut of an earlier release (restored from its checkpoint: :func:`ps_common.plan.plan_for_digest`).
        Any other digest is left for the shards to refuse (PLAN_MISMATCH) at the first request."""
        plan = codec.plan
        if not digest or digest == plan.digest:
            return codec
        try:
            earlier = plan_for_digest(plan.specs, plan.num_shards, plan.partition_bytes, digest)
        except InvalidRequestError:
            return codec
        log.info("the shards hold this model's plan as cut by an earlier release (%s); following it", digest[:12])
        self.codec = WireCodec(earlier, codec.wire_dtype, codec.compressor)
        self.session.plan_digest = earlier.digest
        return self.codec

    def require_codec(self) -> WireCodec:
        """The codec of the plan.

        Raises:
            RuntimeError: ``init`` was not called yet.
        """
        if self.codec is None:
            raise RuntimeError("Call client.init(model, optimizer=...) before push or pull.")
        return self.codec

    @property
    def plan(self) -> Plan:
        return self.require_codec().plan

    def observe(self, histogram: str, start: float) -> None:
        """Record the seconds since ``start`` (``time.perf_counter()``) in ``metrics.<histogram>``."""
        if self.metrics is not None:
            getattr(self.metrics, histogram).observe(time.perf_counter() - start)

    # ------------------------------------------------------------------ init
    def init_shard(self, k: int, values: Mapping[str, torch.Tensor], opt: OptimizerSpec, version: int = 0) -> None:
        """Init shard ``k`` with ``values`` (any device) and the optimizer spec ``opt`` at ``version``.

        Raises:
            ShardError: a refusal (PlanMismatch: the shard holds another plan).
        """
        t, s = self.transport, self.session
        msgs = self.require_codec().init_messages(k, s.rank, s.incarnation, opt, values, s.relayed(k)[0], version)
        try:
            reply = t.call(
                lambda: t.init_calls[k]((t.sent(m) for m in msgs), timeout=t.timeout, metadata=t.call_metadata()),
                f"Init {t.servers[k]}",
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(t.servers[k], exc) from exc
        what = "applied" if reply.applied else "already done"
        log.info("rank %d: shard %d init at version %d %s", s.rank, k, reply.version, what)

    # ------------------------------------------------------------------ push
    def push(
        self,
        grads: Mapping[str, torch.Tensor],
        hyperparameters: Sequence[Mapping[str, float]] | None = None,
        skip: bool = False,
        hold: bool = False,
    ) -> list[ps_pb2.PushResponse]:
        """See :meth:`ps_worker.client.PSClient.push`. ``hold``: sync, hold the round for
        clipping (``ps_worker.clipping``): each answer waits for the round and carries its
        ``clip`` norm."""
        codec = self.require_codec()
        flats = self.staging.stage(codec.plan, grads)
        outs = [codec.out_partitions(k, flats, compress=True) for k in range(self.transport.num_shards)]
        push = Pushed(outs, self.session.push_round(), self.hyperparameters(hyperparameters), skip, hold)
        sent = [0] * self.transport.num_shards

        def one(k: int) -> ps_pb2.PushResponse:
            reply, sent[k] = self.push_shard(k, outs[k], push.round, push.hyperparameters, skip, hold)
            return reply

        try:
            with tracing.span("push", rank=self.session.rank, clock=push.round, shards=self.transport.num_shards):
                return self.send(push, one, lambda reply: reply, "push_duration")
        finally:
            self.session.pushed_bytes += sum(sent)

    def hyperparameters(self, given: Sequence[Mapping[str, float]] | None) -> list[dict[str, float]]:
        """What a push carries: ``given`` (kept for the pushes given none), or the last push's."""
        if given is not None:
            self.last_hyperparameters = [dict(h) for h in given]
        return self.last_hyperparameters

    def send(
        self, push: Pushed, one: Callable[[int], R], answer: Callable[[R], ps_pb2.PushResponse], histogram: str
    ) -> list[R]:
        """The one way a push goes out, for :meth:`push` (``PSClient.push``, clipping) and
        :class:`~ps_worker.transport.pushpull.PendingPushPull` (a step): ``one(k)`` calls shard ``k``
        (recovering; it is :attr:`last` meanwhile, pushed again to a shard that lost it), every shard
        in parallel; then the redo log keeps it (sync, unless held for clipping:
        :mod:`ps_worker.redo`), the session accounts the answers (``answer(result)``) and
        ``metrics.<histogram>`` the seconds.

        Raises:
            grpc.RpcError: as ``one``; a push refused as too stale is counted first (``refused_pushes``).
        """
        self.last = push
        start = time.perf_counter()
        try:
            results = self.transport.each_shard(one)
        except grpc.RpcError as exc:
            if is_stale(exc):  # too stale: the step is done, its gradient refused
                self.session.push_refused()
            raise
        finally:  # from here the gradients may change (zero_grad, the next step): keep the push as sent
            push.outs = [push.outs[k] for k in range(len(push.outs))]
        self.observe(histogram, start)
        if push.round is not None and not push.hold:  # a round held for its clip coefficient is not redone
            self.session.redo_log.record(push.round, push.outs, push.hyperparameters, push.skip, push.samples)
        self.session.account_push([answer(r) for r in results])
        return results

    def push_shard(
        self,
        k: int,
        outs: Sequence[frames.OutPartition],
        round: int | None = None,
        hyperparameters: Sequence[Mapping[str, float]] = (),
        skip: bool = False,
        hold: bool = False,
        samples: int | None = None,
    ) -> tuple[ps_pb2.PushResponse, int]:
        """Push ``outs`` to shard ``k`` (a header message, then one frame per partition); returns its
        answer and the bytes sent. ``round``: sync, the round the gradient is for (every attempt is
        stamped with it; None: the session's clock). ``hyperparameters``, ``skip``: as
        :meth:`ps_worker.client.PSClient.push`; ``hold``: as :meth:`push`; ``samples``: diloco's
        sample count (None: not counted)."""
        t, s, codec = self.transport, self.session, self.require_codec()

        def head() -> bytes:
            stamp = s.stamp(k, round, hyperparameters, skip)
            if samples is not None:
                stamp = dataclasses.replace(stamp, samples=samples)
            if not hold:
                return codec.push_head(stamp)
            header = ps_pb2.PushHeader.FromString(codec.push_header(stamp))
            header.hold_for_clip = True
            return ps_pb2.PushRequest(header=header).SerializeToString()

        def attempt() -> tuple[ps_pb2.PushResponse, int]:
            sent = [0]

            def messages():  # built as gRPC sends them (overlapping the shard's reading)
                for m in codec.push_messages(head(), outs):
                    sent[0] += len(m)
                    yield t.sent(m)

            reply = t.push_calls[k](messages(), timeout=t.timeout, metadata=t.call_metadata())
            s.learn(k, reply)
            return reply, sent[0]

        result = s.with_recovery(k, attempt, f"Push {t.servers[k]}", round=round)
        s.pushed[k] = True
        return result

    def _repush(self, k: int) -> None:
        """After a PushLost: push the last push to shard ``k`` again, for the round it was computed
        for (sync: only when shard ``k`` takes this rank's push in that round now; else the gradient
        is dropped there, and the next step pushes the shard's round)."""
        push = self.last
        if push is None:
            return
        if push.round is not None and self.session.versions[k] != push.round:
            log.info(
                "rank %d: shard %s is at round %d now; the gradient of round %d is not pushed again",
                *(self.session.rank, self.transport.servers[k], self.session.versions[k], push.round),
            )
            return
        self.push_shard(k, push.outs[k], push.round, push.hyperparameters, push.skip, push.hold, push.samples)

    def push_again(self, k: int, reply: ps_pb2.JoinResponse, round: int | None, lost: bool) -> bool:
        """After shard ``k`` restarted from an older checkpoint (``reply``: its Join answer), push it the
        rounds it lost again from the redo log (:mod:`ps_worker.redo`), each answered before the next,
        so that it is where the call being recovered found it: at ``round`` (the round that call
        pushes), or, for a push it lost (``lost``: a pull), past the last round kept.

        Returns:
            True when rounds were pushed again; False when the shard lost none of this rank's rounds,
            keeps none, came back empty (rank 0 wrote it the current values: nothing to redo), or
            counts this rank again from a later round (a rejoin after an eviction).

        Raises:
            LostRoundsError: a lost round is no longer in the log. ShardError: a refusal meanwhile.
        """
        s, t = self.session, self.transport
        start, last = int(reply.clock), s.redo_log.last_round()
        end = round if round is not None else (last + 1 if lost and last is not None else None)
        if start > reply.version or not reply.version or not s.redo_log.active or end is None or start >= end:
            return False  # a shard at version 0 came back empty and was written the current values: none lost
        entries = s.redo_log.rounds(k, start, end)
        log.warning(
            "rank %d: shard %s restarted from its checkpoint at version %d and lost rounds %d..%d; pushing them again",
            *(s.rank, t.servers[k], reply.version, start, end - 1),
        )
        keys = {p.key for p in self.require_codec().owned[k]}  # each answer's values are read and dropped
        scratch = {p.key: torch.empty(p.numel, dtype=torch_dtype(p.dtype)) for p in self.plan.specs if p.key in keys}
        for e in entries:
            self.push_shard(k, e.outs[k], e.round, e.hyperparameters, e.skip, samples=e.samples)
            self.pull_shard(k, scratch, e.round + 1)
            s.versions[k], s.pushed[k] = e.round + 1, False
        s.recoveries["REDONE_ROUNDS"] += len(entries)
        return True

    # ------------------------------------------------------------------ pull
    def pull(
        self,
        out: Mapping[str, torch.Tensor],
        min_version: int | None = None,
        clip: ps_pb2.ClipCoefficient | None = None,
    ) -> int:
        """See :meth:`ps_worker.client.PSClient.pull`. ``clip``: step the round held for clipping
        with this coefficient before reading (``ps_worker.clipping``)."""
        t, s = self.transport, self.session
        flats, device_out = self.staging.pull_targets(self.require_codec().plan, out)
        start = time.perf_counter()
        with tracing.span("pull", rank=s.rank, min_version=min_version, shards=t.num_shards):
            results = t.each_shard(lambda k: self.pull_shard(k, flats, min_version, clip))
        self.observe("pull_duration", start)
        s.pulled_bytes += sum(r[1] for r in results)
        return self.finish_pull([r[0] for r in results], device_out, flats)

    def pull_shard(
        self,
        k: int,
        flats: Mapping[str, torch.Tensor],
        min_version: int | None = None,
        clip: ps_pb2.ClipCoefficient | None = None,
    ) -> tuple[int, int]:
        """Pull shard ``k``'s partitions into ``flats`` (1-D tensors by key) at ``min_version`` or the
        mode's floor, recovering; returns (version, bytes received)."""
        t, s, codec = self.transport, self.session, self.require_codec()

        def attempt() -> tuple[int, int]:  # the floor per attempt: a recovery may move this shard's round
            req = codec.pull_request(s.rank, s.incarnation, s.pull_floor(k, min_version), s.relayed(k)[0])
            if clip is not None:
                req.clip.CopyFrom(clip)
            replies = t.pull_calls[k](req, timeout=t.timeout, metadata=t.call_metadata())
            version, received, _ = codec.decode(k, replies, flats, t.servers[k], t.received)
            return version, received

        try:
            return s.with_recovery(k, attempt, f"Pull {t.servers[k]}")
        except grpc.RpcError as exc:
            if is_stale(exc):  # the round awaited was refused: no push of ours is held
                s.pushed[k] = False
            raise

    def finish_pull(
        self, versions: list[int], device_out: Mapping[str, torch.Tensor], flats: Mapping[str, torch.Tensor]
    ) -> int:
        """Copy staged values to the device and adopt the shards' ``versions``; returns the lowest."""
        self.staging.unstage(device_out, flats)
        return self.session.adopt_versions(versions)
