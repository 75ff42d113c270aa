"""A shard's Init, Push, Pull, PushPull and Exchange as calls: the phases in which each takes the shard's
lock around :class:`~ps_server.shard.data.DataPath`, whose methods assume it held.

Each call matches the request's partitions to the plan without the lock (the work that needs no
shared state: :func:`~ps_server.core.partitions.match_partitions`), then checks and applies under
it; a PushPull reads its answer in the same hold. An answer with ``durable_acks`` waits for its
checkpoint under the lock (:meth:`DataPath.wait_durable`). The shard (``ps_server.shard.shard.Shard``)
serves them as its own ``init``, ``push``, ``pull``, ``push_pull`` and ``exchange``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ps_common import tracing
from ps_common.errors import PSError
from ps_common.fragments import fragments_in_force, owned_slots
from ps_common.optimizer import OptimizerSpec
from ps_common.partition import WirePartition
from ps_common.plan import ParameterSpec, Plan
from ps_proto.v1 import ps_pb2
from ps_server.core.partitions import Bounded, match_partitions
from ps_server.membership.epochs import Epochs
from ps_server.membership.ranks import PushResult, PushStamp
from ps_server.policy import POLICIES
from ps_server.policy.sync import Hyperparameters, SyncRounds
from ps_server.shard.data import DataHost, DataPath
from ps_server.shard.round_stream import RoundStream
from ps_server.shard.store import ParameterStore
from ps_server.shard.views import Snapshot, clone_tensors

log = logging.getLogger(__name__)


class CallsHost(DataHost, Protocol):
    """What the data calls use of their shard besides what :class:`DataPath` does."""

    durable_acks: bool
    data: DataPath
    epochs: Epochs

    def install(self, plan: Plan, store: ParameterStore) -> None:
        """Take ``plan`` and ``store`` (lock held)."""


class DataCalls:
    """Init, Push, Pull, PushPull and Exchange of one shard: each takes the shard's lock ``cond`` in the
    phases its docstring says, and calls :class:`DataPath` (``host.data``) under it.

    Args:
        host: the shard, as :class:`CallsHost` says.
        cond: the shard's condition (its lock).
    """

    def __init__(self, host: CallsHost, cond: threading.Condition) -> None:
        self._host, self._cond = host, cond

    def init(
        self,
        specs: Sequence[ParameterSpec],
        num_shards: int,
        partition_bytes: int,
        digest: str,
        optimizer: OptimizerSpec,
        partitions: Sequence[WirePartition],
        plan: Plan | None = None,
        version: int = 0,
    ) -> tuple[bool, int, str]:
        """First writer wins: set the plan, initial values and optimizer (``plan``: :meth:`DataPath.init_plan`
        of the other arguments, when the caller has it) at ``version`` (diloco: a shard that restarted
        empty takes theta_global at the ranks' outer round). Returns (applied, version, plan digest):
        not applied when already initialized with the same plan.

        Raises:
            InvalidRequestError: as :meth:`DataPath.init_plan`, a bad partition or optimizer spec.
            PlanMismatchError: already initialized with another plan.
        """
        host = self._host
        plan = plan or host.data.init_plan(specs, num_shards, partition_bytes, digest)
        with self._cond:
            if host.plan is not None:
                return host.data.initialized(digest)
        values = match_partitions(plan, host.shard_index, partitions, "value")
        store = ParameterStore(plan, host.shard_index, values, optimizer)
        with self._cond:
            if host.plan is not None:  # lost a race with another Init
                return host.data.initialized(digest)
            host.install(plan, store)
            if version:
                host.rounds = SyncRounds(round=version)
                host.set_version(version)  # and the config changes due there
            what = (host.shard_index, len(store.partitions), store.num_bytes, plan.digest[:12], optimizer.name, version)
            log.info("shard %d: initialized with %d partitions (%d B), plan %s, optimizer %s, at version %d", *what)
            self._cond.notify_all()
            return True, host.version, plan.digest

    def push(
        self,
        stamp: PushStamp,
        grad_version: int,
        plan: Plan,
        partitions: Sequence[WirePartition],
        hyper: Hyperparameters = (),
        skip: bool = False,
        stream: RoundStream | None = None,
    ) -> PushResult:
        """Accept the gradients of ``stamp`` (a repeat is answered as the first time); the policy
        applies, holds or refuses it; answered once durable with ``durable_acks``. ``plan``: the one
        the request's header was checked against (:meth:`DataPath.check_plan`, not checked again).
        Errors: :meth:`DataPath.push`."""
        result, durable = self._push(stamp, grad_version, plan, partitions, hyper, skip, stream)
        if durable:  # applied: answered once durable (a held push is answered held)
            self.wait_durable(result.version, None)
        return result

    def _push(
        self,
        stamp: PushStamp,
        grad_version: int,
        plan: Plan,
        partitions: Sequence[WirePartition],
        hyper: Hyperparameters,
        skip: bool,
        stream: RoundStream | None,
    ) -> tuple[PushResult, bool]:
        """Match ``partitions`` to ``plan`` (checked by the caller) without the lock, then
        :meth:`_admit` in one hold of it."""
        matched = self._match(plan, stamp, partitions)
        with self._cond:
            return self._admit(stamp, grad_version, matched, hyper, skip, stream)

    def _match(self, plan: Plan, stamp: PushStamp, partitions: Sequence[WirePartition]) -> Bounded | PSError:
        """The push's gradients matched to ``plan`` (no lock: :func:`match_partitions`), or why not."""
        try:
            return match_partitions(
                plan, self._host.shard_index, partitions, "gradient", expected=self.slots(plan, stamp)
            )
        except PSError as exc:
            return exc

    def _admit(
        self,
        stamp: PushStamp,
        grad_version: int,
        matched: Bounded | PSError,
        hyper: Hyperparameters,
        skip: bool,
        stream: RoundStream | None,
    ) -> tuple[PushResult, bool]:
        """:meth:`DataPath.push` of the matched gradients (lock held). Partitions that did not match
        (``matched`` is the refusal) are still answered as the first time for a repeated push (a
        diloco fragment count changed since); otherwise refused. Returns (result, wait until durable)."""
        data = self._host.data
        if isinstance(matched, PSError):
            seen = data.repeated(self._host.membership.get(stamp.rank, stamp.incarnation), stamp)
            if seen is None:
                raise matched
            return seen, False
        return data.push(stamp, grad_version, matched, hyper, skip, stream)

    def slots(self, plan: Plan, stamp: PushStamp) -> tuple[int, ...] | None:
        """The partitions (indices into the shard's) a push of ``stamp`` carries: diloco with F > 1
        fragments, those of fragment ``clock mod F`` (:func:`ps_common.fragments.owned_slots`); else None, all."""
        return owned_slots(plan, self._host.shard_index, fragments_in_force(self._host.settings), stamp.clock)

    def wait_durable(self, version: int, deadline: float | None) -> None:
        """With ``durable_acks``: wait until ``version`` is checkpointed; see :meth:`DataPath.wait_durable`."""
        if self._host.durable_acks:
            with self._cond:
                self._host.data.wait_durable(version, deadline)

    def pull(
        self,
        rank: int,
        incarnation: int,
        min_version: int,
        digest: str,
        timeout: float | None,
        wire_dtype: str = "",
        encode: Callable[[Snapshot], Any] = clone_tensors,
    ) -> tuple[int, Any]:
        """Wait until this rank may read, then return (version, ``encode(snapshot)``), ``encode``
        called under the lock; ``timeout`` in seconds (None: until the shard closes). Arguments and
        errors: :meth:`DataPath.check_plan`, :meth:`DataPath.read`."""
        self._host.data.check_plan(digest, wire_dtype)
        deadline = None if timeout is None else self._host.now() + timeout
        with self._cond:
            return self._host.data.read(rank, incarnation, min_version, deadline, timeout, encode)

    def push_pull(
        self,
        stamp: PushStamp,
        grad_version: int,
        plan: Plan,
        partitions: Sequence[WirePartition],
        timeout: float | None,
        encode: Callable[[Snapshot], Any],
        wire_dtype: str = "",
        check: Callable[[Plan], None] | None = None,
        hyper: Hyperparameters = (),
        skip: bool = False,
        stream: RoundStream | None = None,
        request_epoch: int = 0,
    ) -> tuple[PushResult, int, Any, tuple[int, ps_pb2.MembershipEpoch | None]]:
        """:meth:`push`, then :meth:`pull` of the version it lands in (sync: ``clock + 1``; the others: no minimum):
        ``plan`` is the one the request's header was checked against (:meth:`DataPath.check_plan`: not compared
        again), the wire dtype checked against it, the partitions matched without the lock, then the lock held once
        for the push and the read, which also reads what the answer tells (the shard's membership epoch, and its
        record when ``request_epoch``, the requester's, is older). ``check`` is called with the plan before the push
        (PushPullOnce: the answer must fit in one message). Returns (push result, version, ``encode(snapshot)``,
        (epoch, record or None)); sync: the result says whether the round was skipped. With ``durable_acks`` an
        applied push waits until its version is durable before the read (the read then carries the pushes
        applied meanwhile: async SGD with a checkpoint per version converges on them), and the answer waits
        until the version read is durable.

        Raises:
            Everything :meth:`push`, :meth:`pull` and ``check`` raise; a refused push pulls nothing.
        """
        host = self._host
        start = host.now()
        host.data.check_wire_dtype(plan, wire_dtype)
        if check is not None:
            check(plan)
        matched = self._match(plan, stamp, partitions)
        deadline = None if timeout is None else start + timeout
        with self._cond:  # one hold: the push, then the read (a sync read waits in it, the lock released)
            with tracing.span("push", rank=stamp.rank, clock=stamp.clock, partitions=len(partitions)):
                result, durable = self._admit(stamp, grad_version, matched, hyper, skip, stream)
            policy = POLICIES[result.mode]  # the mode that took the push
            if durable and host.durable_acks:  # before the read: the answer carries what was applied meanwhile
                host.data.wait_durable(result.version, deadline)
            remaining = None if timeout is None else max(0.0, timeout - (host.now() - start))
            min_version = policy.read_after_push(stamp.clock)
            with tracing.span("pull", rank=stamp.rank, min_version=min_version, mode=result.mode):  # waits, encodes
                version, out = host.data.read(stamp.rank, stamp.incarnation, min_version, deadline, remaining, encode)
            if policy.holds_pushes and not result.dropped and stamp.clock in host.skipped_rounds:
                result = dataclasses.replace(result, skipped=True)
            told = host.epochs.epoch, host.epochs.for_request(request_epoch)
            if host.durable_acks:  # the version read, newer than the push's
                host.data.wait_durable(version, deadline)
        return result, version, out, told

    def exchange(
        self,
        stamp: PushStamp,
        digest: str,
        partitions: Sequence[WirePartition],
        timeout: float | None,
        encode: Callable[[Snapshot], Any] = clone_tensors,
    ) -> tuple[int, Any]:
        """EASGD exchange: return (version, ``encode`` of d = alpha (x - center)); a repeat gets the
        original d. Arguments and errors: :meth:`DataPath.admit_exchange`, :meth:`DataPath.apply_exchange`."""
        deadline = None if timeout is None else self._host.now() + timeout
        with self._cond:
            plan, member, answer = self._host.data.admit_exchange(stamp, digest, encode)
            if answer is not None:
                return answer
        x = match_partitions(plan, self._host.shard_index, partitions, "parameter")
        with self._cond:
            return self._host.data.apply_exchange(member, stamp, x, deadline, encode)
