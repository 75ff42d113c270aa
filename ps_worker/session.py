"""A worker's session with the shards: who it is, where it is, and how it gets back in step.

:class:`Session` holds the rank, incarnation, clock and the shards' versions, joins the shards,
keeps the lease alive with a heartbeat thread, and recovers from the refusals that name a fixable
cause (:data:`ps_worker.errors.RECOVERABLE`). The data calls (:mod:`ps_worker.transport.calls`,
:mod:`ps_worker.transport.pushpull`) stamp their requests and account their answers through it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import grpc

from ps_common.errors import NotInitializedError, NotJoinedError, PSError, PushLostError
from ps_common.modes import ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_common.wire import MODE_TO_NAME, optimizer_from_proto
from ps_proto.v1 import ps_pb2
from ps_worker.awaiting import PeerWaits
from ps_worker.consistency import WorkerMode, settings_from_config, worker_mode
from ps_worker.errors import HINT_UNREACHABLE, RECOVERABLE, ShardUnreachableError, error_from_rpc
from ps_worker.heartbeat import Heartbeat
from ps_worker.redo import DEFAULT_REDO_BYTES, RedoLog
from ps_worker.relay import EpochRelay
from ps_worker.transport.encoding import Stamp
from ps_worker.transport.grpc_link import Transport
from ps_worker.transport.retry import RETRYABLE, backoff_delays

log = logging.getLogger(__name__)
T = TypeVar("T")

WARN_UNREACHABLE_AFTER = 2.0
"""Seconds a shard may stay unreachable at Join before a warning names its address."""

JOIN_ATTEMPT_SECONDS = 5.0
"""Longest single Join attempt, seconds (Join answers in milliseconds; the rest is connecting)."""


class Session:
    """Membership and progress of one worker process at every shard.

    Args:
        transport: the channels to the shards.
        rank: this worker's rank, ``0 <= rank < num_workers``.
        num_workers: ranks in the cluster.
        incarnation: grows each time this rank restarts. redo_bytes: the bound of :attr:`redo_log`.

    Attributes:
        clock: completed steps (pushes) of this rank; exchanges: completed EASGD exchanges.
        versions: per shard, the version of the parameters this rank last pulled; version: their minimum.
        pushed: per shard, a push of this rank waits in the shard's open round (sync).
        settings: the mode and its parameters, as the shards announced them at Join.
        recoveries: how often each :class:`~ps_common.errors.Reason` was recovered from.
        staleness: histogram of the staleness of this rank's applied pushes (async, ssp).
        reinit, repush: rank 0 writes shard ``k``'s values again; the last gradient pushed again (the client's).
        redo_log, redo: sync, this rank's pushes of the rounds a shard could lose (:mod:`ps_worker.redo`),
            and what pushes them again after its restart (set by the client; see :meth:`recover`).
        epochs: the membership records as this worker knows them (:class:`~ps_worker.relay.EpochRelay`).
        on_resize: called with a membership record that changes the worker count.
        waits: calls waiting for other ranks, called again while those are alive.
        recovering: held by a recovery (:meth:`recover`): one at a time, a table call's included.
    """

    def __init__(
        self, transport: Transport, rank: int, num_workers: int, incarnation: int, redo_bytes: int = DEFAULT_REDO_BYTES
    ) -> None:
        self.transport = transport
        self.rank, self.num_workers, self.incarnation = rank, num_workers, incarnation
        n = transport.num_shards
        self.worker: WorkerMode = worker_mode("")
        self._mode = ""
        self.settings: ModeSettings | None = None
        self.config = ps_pb2.ClusterConfig()
        self.lease_timeout = 10.0
        self.clock = 0
        self.exchanges = 0
        self.version = 0
        self.versions = [0] * n
        self.pushed = [False] * n
        self.sessions = [0] * n  # per shard: this rank's session there (JoinResponse.session)
        self.pushed_bytes = 0
        self.pulled_bytes = 0
        self.refused_pushes = 0
        self.dropped_pushes = 0
        self.staleness: Counter[int] = Counter()
        self.recoveries: Counter[str] = Counter()
        self.last_step_skipped = False
        self.optimizer: OptimizerSpec | None = None
        self.plan_digest = ""
        self.reinit: Callable[[int], None] | None = None
        self.repush: Callable[[int], None] | None = None
        self.redo_log = RedoLog(n, redo_bytes)
        self.recovering = threading.RLock()
        self.redo: Callable[[int, ps_pb2.JoinResponse, int | None, bool], bool] | None = None
        self.epochs = EpochRelay(n, self._resized)
        self.on_resize: Callable[[ps_pb2.MembershipEpoch], None] | None = None
        self.heartbeat = Heartbeat(transport, rank, incarnation, self.epochs, self.redo_log)
        self.waits = PeerWaits(rank)

    @property
    def mode(self) -> str:
        """The cluster's mode ("" before the first Join)."""
        return self._mode

    @mode.setter
    def mode(self, name: str) -> None:
        self.worker = worker_mode(name)
        self._mode = name

    # ------------------------------------------------------------------ membership records
    @property
    def membership(self) -> ps_pb2.MembershipEpoch:
        """The newest membership record this worker has seen (epoch 0: none yet)."""
        return self.epochs.membership

    def relayed(self, k: int) -> tuple[int, ps_pb2.MembershipEpoch | None]:
        """What a request to shard ``k`` carries (:meth:`EpochRelay.relayed`)."""
        return self.epochs.relayed(k)

    def learn(self, k: int, answer: object) -> None:
        """Adopt the membership record of shard ``k``'s answer (:meth:`EpochRelay.learn`)."""
        self.epochs.learn(k, answer)

    def in_cluster(self, clock: int) -> bool:
        """Whether this rank pushes step ``clock`` (:meth:`EpochRelay.in_cluster`, at the mode's ``resize_clock``)."""
        return self.epochs.in_cluster(self.rank, self.worker.resize_clock(self, clock), self.worker)

    def _resized(self, record: ps_pb2.MembershipEpoch) -> None:
        previous, self.num_workers = self.num_workers, int(record.num_workers)
        if previous != self.num_workers:
            log.info(
                "rank %d: the cluster has %d workers from version %d on (was %d; membership epoch %d)",
                self.rank,
                self.num_workers,
                record.resize_version,
                previous,
                record.epoch,
            )
        if self.on_resize is not None:
            self.on_resize(record)

    # ------------------------------------------------------------------ joining
    def join_request(self, k: int = 0) -> ps_pb2.JoinRequest:
        epoch, record = self.relayed(k)
        return ps_pb2.JoinRequest(
            rank=self.rank,
            num_workers=self.num_workers,
            incarnation=self.incarnation,
            membership_epoch=epoch,
            membership=record,
        )

    def join_shard(self, k: int) -> ps_pb2.JoinResponse:
        """Join shard ``k``, retrying while it is unreachable (still starting, restarting) for at most
        ``retry_deadline`` seconds; after :data:`WARN_UNREACHABLE_AFTER` seconds a warning names the
        address.

        Raises:
            ShardUnreachableError: no answer within ``retry_deadline``. ShardError: a refusal.
        """
        t = self.transport
        address = t.servers[k]
        req = self.join_request(k)
        start = time.monotonic()
        stop = start + t.retry_deadline
        delays = backoff_delays(base=0.05, cap=0.5)  # a shard still starting (ps-launch) serves within seconds
        warned = False
        while True:
            # each attempt is short: a connection that hangs (a dropped SYN) must not use the whole budget
            attempt = max(0.1, min(t.timeout, stop - time.monotonic(), JOIN_ATTEMPT_SECONDS))
            try:
                return self._join_once(k, req, attempt)
            except grpc.RpcError as exc:
                code = exc.code()
                if code not in RETRYABLE:
                    raise error_from_rpc(address, exc) from exc
                now = time.monotonic()
                if now >= stop:
                    raise ShardUnreachableError(address, code, exc.details() or "", t.retry_deadline) from exc
                if not warned and now - start >= WARN_UNREACHABLE_AFTER:
                    warned = True
                    log.warning(
                        "rank %d: shard %s not reachable yet (%s: %s); %s. Retrying for up to %g s (--retry-deadline).",
                        *(self.rank, address, code.name, exc.details(), HINT_UNREACHABLE, t.retry_deadline),
                    )
                time.sleep(max(0.0, min(next(delays), stop - now)))

    def join(self) -> list[ps_pb2.JoinResponse]:
        """Join every shard, take the mode and this rank's progress from their answers, and start
        the heartbeat thread.

        Raises:
            ShardUnreachableError: a shard did not answer within ``retry_deadline``.
            ShardError: a shard refused the join.
            RuntimeError: the shards disagree on mode or their indices do not match ``servers``.
        """
        t = self.transport
        # shard 0 first: it decides whether this rank counts (a rejoin after an eviction), and the
        # others follow the record its answer brings, which the joins to them carry
        first = self.join_shard(0)
        replies = t.each_shard(lambda k: first if k == 0 else self.join_shard(k))
        for k, r in enumerate(replies):
            if r.shard_index != k or r.num_shards != t.num_shards:
                raise RuntimeError(
                    f"{t.servers[k]} is shard {r.shard_index} of {r.num_shards}, but it is listed at "
                    f"position {k} of {t.num_shards}; list every shard in shard-index order."
                )
        modes = {r.config.mode for r in replies}
        if len(modes) != 1:
            raise RuntimeError(f"Shards disagree on the mode ({sorted(MODE_TO_NAME[m] for m in modes)}).")
        self.config = replies[0].config
        self.settings = settings_from_config(self.config)
        self.mode = self.settings.mode
        self.lease_timeout = self.config.lease_timeout_seconds or 10.0
        self.worker.adopt_join(self, replies)
        self.heartbeat.start(self.lease_timeout)
        logging.getLogger("ps_worker.startup").debug("start-up: joined %d shards (rank %d)", t.num_shards, self.rank)
        return replies

    def wait_initialized(self, replies: Mapping[int, ps_pb2.JoinResponse], init_timeout: float) -> None:
        """Poll Join on the shards of ``replies`` (shard -> last reply) until rank 0 initialized them.

        Raises:
            TimeoutError: a shard was not initialized within ``init_timeout`` seconds.
            RuntimeError: a shard holds another plan than ``plan_digest`` (every worker must build
                the same model). ShardError: a refused Join.
        """
        t = self.transport
        stop = time.monotonic() + init_timeout
        delays = backoff_delays(base=0.02, cap=0.1)  # a Join answers in ms: rank 0's Init is seen within 0.1 s
        for k, reply in replies.items():
            while not reply.initialized:
                if time.monotonic() > stop:
                    raise TimeoutError(
                        f"Shard {t.servers[k]} was not initialized within {init_timeout:.0f} s; is rank 0 running?"
                    )
                time.sleep(next(delays))
                try:
                    reply = t.call(functools.partial(self._join_once, k), "Join")
                except grpc.RpcError as exc:
                    raise error_from_rpc(t.servers[k], exc) from exc
            if reply.HasField("optimizer"):  # start from rank 0's spec, as the shards do
                self.optimizer = optimizer_from_proto(reply.optimizer)
            if reply.plan_digest != self.plan_digest:
                raise RuntimeError(
                    f"Shard {t.servers[k]} holds plan {reply.plan_digest[:12]} but this model's plan is "
                    f"{self.plan_digest[:12]}; every worker must build the same model."
                )

    def _join_once(
        self, k: int, req: ps_pb2.JoinRequest | None = None, timeout: float | None = None
    ) -> ps_pb2.JoinResponse:
        t = self.transport
        req = self.join_request(k) if req is None else req
        reply = t.stubs[k].Join(req, timeout=t.timeout if timeout is None else timeout, metadata=t.metadata)
        self.sessions[k] = reply.session
        self.learn(k, reply)
        self.redo_log.learn(k, reply)
        t.offer_data_port(k, reply.data_port)
        return reply

    # ------------------------------------------------------------------ heartbeats
    # ------------------------------------------------------------------ recovery
    def with_recovery(self, k: int, fn: Callable[[], T], what: str, repush: bool = True, round: int | None = None) -> T:
        """``fn`` under the transport's one retry policy (:class:`~ps_worker.transport.retry.CallPolicy`):
        transient errors retried, called again while the ranks it waits for are alive (:attr:`waits`),
        and at most :data:`~ps_worker.transport.retry.MAX_RECOVERIES` recoveries from refusals that name
        a fixable cause (see :meth:`recover`; ``repush=False`` when ``fn`` pushes again itself, as
        PushPull does; ``round``: sync, the round ``fn`` pushes).

        Raises:
            ShardError: the typed error of the last failure (:func:`~ps_worker.errors.error_from_rpc`),
                its ``deadline`` naming the deadline that ended the call (None: a refusal).
        """
        address = self.transport.servers[k]
        return self.transport.policy.call(
            fn,
            what,
            address=address,
            waits=self.waits,
            error=lambda exc: error_from_rpc(address, exc, waits=not what.startswith("Push ")),
            recover=lambda err: isinstance(err, PSError) and self.recover(k, err, repush, round),
        )

    def recover(self, k: int, err: PSError, repush: bool = True, round: int | None = None) -> bool:
        """Bring shard ``k`` and this session back in step after a refusal; True when the call
        should be made again.

        - NotJoinedError (evicted after a partition, or the shard restarted): Join again.
        - NotInitializedError (the shard restarted empty): rank 0 writes its values again, the others wait.
        - FutureRoundError (the shard restarted from an older checkpoint): adopt its round.
        - PushLostError (it lost an acknowledged push of an open round): push the last gradient again.
        - sync, then: a shard restarted from an older checkpoint gets its lost rounds (:attr:`redo`).

        Args: round: sync, the round the recovered call pushes (its gradient's); None: none.

        Raises:
            StalePush: the mode refuses the rejoin's round (sync: the step's gradient is dropped:
                ``WorkerMode.after_rejoin``).
        """
        if not isinstance(err, RECOVERABLE):
            return False
        with self.recovering:  # one at a time (a table call's and the step's: ps_worker.tables.client)
            return self._recover(k, err, repush, round)

    def _recover(self, k: int, err: PSError, repush: bool, round: int | None) -> bool:
        address = self.transport.servers[k]
        log.warning("rank %d: shard %s refused (%s: %s); recovering", self.rank, address, err.reason, err.details())
        self.recoveries[str(err.reason)] += 1
        if isinstance(err, NotInitializedError):
            if self.rank == 0 and self.reinit is not None:
                self.reinit(k)
            else:
                self.wait_initialized({k: self.join_shard(k)}, self.transport.retry_deadline)
        try:
            reply = self.join_shard(k)
        except NotJoinedError:
            if k == 0:
                raise
            self.join_shard(0)  # shard 0 stopped counting this rank: it decides the rejoin
            reply = self.join_shard(k)
        self.versions[k] = reply.version
        self.pushed[k] = False
        lost = isinstance(err, PushLostError)
        if self.redo is not None and self.worker.pushes_in_rounds and self.redo(k, reply, round, lost):
            return True  # the rounds the shard lost are pushed again: it is where this call left it
        self.worker.after_rejoin(self, k, reply, round, address)
        if lost and repush and self.repush is not None:
            self.repush(k)
        return True

    # ------------------------------------------------------------------ stamps and answers
    def stamp(
        self,
        k: int,
        clock: int | None = None,
        hyperparameters: Sequence[Mapping[str, float]] = (),
        skip: bool = False,
    ) -> Stamp:
        """What a push to shard ``k`` carries now: ``clock``, or the mode's
        (:meth:`WorkerMode.push_clock`); the step's ``hyperparameters`` (per parameter group) and
        ``skip`` (AMP found inf)."""
        epoch, record = self.relayed(k)
        return Stamp(
            self.rank,
            self.incarnation,
            self.worker.push_clock(self, k) if clock is None else clock,
            self.versions[k],
            hyperparameters,
            skip,
            epoch,
            record,
            self.sessions[k],
        )

    def push_round(self) -> int | None:
        """sync: the round a push made now is for, the same on every shard (fixed for the push,
        retries included: see :meth:`recover`); other modes: None (the clock is the step count)."""
        return self.worker.push_round(self)

    def pull_floor(self, k: int, min_version: int | None) -> int:
        """The version a pull from shard ``k`` waits for: ``min_version``, or the mode's."""
        return min_version if min_version is not None else self.worker.pull_floor(self, k)

    def push_refused(self) -> None:
        """A push refused as too stale: the step is done (the clock advances), its gradient refused."""
        self.refused_pushes += 1
        self.clock += 1

    def account_push(self, replies: Sequence[ps_pb2.PushResponse]) -> None:
        """Clock, counters, a live mode switch and the shards' newest checkpoints, after a push."""
        self.clock += 1
        for k, r in enumerate(replies):
            self.redo_log.learn(k, r)
        self.last_step_skipped = any(r.skipped for r in replies)
        first = replies[0]
        if first.dropped:
            self.dropped_pushes += 1
        elif not first.duplicate and self.worker.counts_staleness:
            self.staleness[int(first.staleness)] += 1
        new = MODE_TO_NAME.get(first.mode, self.mode) if first.mode else self.mode
        if new != self.mode:
            log.info("rank %d: the cluster switched from %s to %s", self.rank, self.mode, new)
            self.mode = new
            if self.settings is not None:
                self.settings = dataclasses.replace(self.settings, mode=new)

    def adopt_versions(self, versions: list[int]) -> int:
        """The shards' versions after a pull (nothing of this rank is held in an open round now);
        returns the lowest."""
        self.versions = versions
        self.pushed = [False] * len(versions)
        self.version = min(versions)
        return self.version

    def close(self) -> None:
        """Stop the heartbeat, leave every shard (best effort), close the transport and join the
        heartbeat thread. Idempotent."""
        self.heartbeat.stop(wait=False)

        def leave(k: int) -> ps_pb2.LeaveRequest:  # shard 0 first: the others get its record
            epoch, record = self.relayed(k)
            return ps_pb2.LeaveRequest(
                rank=self.rank,
                incarnation=self.incarnation,
                membership_epoch=epoch,
                membership=record,
                session=self.sessions[k],
            )

        self.transport.close(leave, self.learn)
        self.heartbeat.stop(wait=True)
