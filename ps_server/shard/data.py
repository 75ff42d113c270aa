"""The data path of a :class:`~ps_server.shard.shard.Shard`: Push, Pull, PushPull and Exchange.

Each call checks everything before it touches state, answers a repeated :class:`PushStamp` with the
original answer (idempotence), and leaves the decision to the shard's consistency policy: what a
push does (:meth:`~ps_server.policy.base.ConsistencyPolicy.accept`), when a read is served
(``check_read``/``can_read``/``blocked``/``after_read``) and how an exchange applies. A read hands
the caller's ``encode`` a :class:`~ps_server.shard.views.Snapshot` under the lock.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from ps_common.errors import StalePushError
from ps_common.partition import WirePartition
from ps_common.plan import Plan
from ps_server.core.partitions import match_partitions
from ps_server.membership.ranks import Member, PushResult, PushStamp, WorkerState
from ps_server.policy import POLICIES
from ps_server.shard import round_stream
from ps_server.shard.views import Snapshot, clone_tensors

if TYPE_CHECKING:
    from ps_server.membership.ranks import Membership
    from ps_server.policy import ConsistencyPolicy
    from ps_server.policy.sync import Hyperparameters
    from ps_server.shard.counters import ShardCounters
    from ps_server.shard.round_stream import RoundStream
    from ps_server.shard.store import ParameterStore

T = TypeVar("T")


class DataPath:
    """Push, Pull, PushPull and Exchange of :class:`~ps_server.shard.shard.Shard` (a mixin: the state,
    the lock and the policy glue are the shard's)."""

    _cond: threading.Condition
    _now: Callable[[], float]
    _store_epoch: int
    shard_index: int
    plan: Plan | None
    store: ParameterStore | None
    version: int
    mode: str
    policy: ConsistencyPolicy
    membership: Membership
    counters: ShardCounters
    refusals: dict
    skipped_rounds: dict[int, None]

    if TYPE_CHECKING:

        def check_plan(self, digest: str) -> Plan: ...
        def check_wire_dtype(self, plan: Plan, wire_dtype: str) -> None: ...
        def advance(self) -> None: ...
        def wait_for_ranks(
            self, ready: Callable[[], bool], deadline: float | None, describe: Callable[[], str]
        ) -> None: ...

    def push(
        self,
        stamp: PushStamp,
        grad_version: int,
        digest: str,
        partitions: Sequence[WirePartition],
        hyper: Hyperparameters = (),
        skip: bool = False,
        stream: RoundStream | None = None,
    ) -> PushResult:
        """Accept the gradients of ``stamp``; a repeated stamp is answered with the original result
        and applied once. The policy applies the push at once (async, ssp), holds it for round
        ``stamp.clock`` (sync) or refuses it (easgd: workers call Exchange).

        Args:
            grad_version: the version the gradients were computed on (async staleness).
            partitions: one gradient per partition of this shard (any order; checked against the plan).
            hyper: per parameter group, the hyperparameters (lr...) of the step this push joins;
                they stay in force after it. sync: the round's ranks must agree, or the round is
                refused (HyperparametersDisagreeError). () keeps the shard's own.
            skip: skip the step (AMP overflow); the gradients are ignored. sync: the round closes
                as usual but applies nothing; async, ssp: the push counts, the version stays.
            stream: sync, the streamed round this push's partitions were stepped in
                (:mod:`ps_server.shard.round_stream`); None: any stream of the round cannot stand for it.

        Raises:
            InvalidRequestError: bad rank or partitions. NotInitializedError, PlanMismatchError,
            PreconditionError: not initialized, other plan, not joined, easgd mode.
            StalePushError: sync round closed (no quorum), async staleness above the bound, or a
            replayed clock. UpdateRefusedError: the update (or its round) was refused.
        """
        with self._cond:
            plan = self.check_plan(digest)
            member = self.membership.get(stamp.rank, stamp.incarnation)
            seen = member.history.get((stamp.incarnation, stamp.clock))
            if seen is not None:
                return PushResult(seen.version, seen.staleness, True, seen.dropped, self.mode)
            self.membership.check_live(member, stamp.incarnation)
            self._check_replay(member, stamp)
            if hyper:
                assert self.store is not None
                self.store.check_hyperparameters(hyper)
        grads = match_partitions(plan, self.shard_index, partitions, "gradient")
        with self._cond:
            self.membership.check_live(member, stamp.incarnation)
            seen = member.history.get((stamp.incarnation, stamp.clock))
            if seen is not None:
                return PushResult(seen.version, seen.staleness, True, seen.dropped, self.mode)
            self._check_replay(member, stamp)
            self._check_counted(member, stamp)
            policy = self.policy
            result = policy.accept(self, member, stamp, grad_version, grads, hyper, skip)
            if policy.holds_pushes and not result.dropped:
                round_stream.held(self, stamp.rank, stream)  # type: ignore[arg-type]
            self.advance()
            if policy.holds_pushes and not result.dropped:
                refusal = self.refusals.pop(stamp.rank, None)
                if refusal is not None:  # this push completed its round, and the round was refused
                    raise type(refusal)(str(refusal))
            applied = self.version
        if not policy.holds_pushes:  # applied: answered once durable (a held push is answered held)
            self.wait_durable(applied, None)
        return result

    def wait_durable(self, version: int, deadline: float | None) -> None:
        """With ``durable_acks``: wait until ``version`` is in a checkpoint on disk (the checkpointer
        writes every version), so the answer about to be sent survives a kill -9 of the shard.

        Raises:
            WaitTimeoutError: not durable by ``deadline``. ShuttingDownError: closing.
        """
        if not self.durable_acks:
            return
        with self._cond:
            self.waits.until(
                lambda: (self.last_checkpoint_version or 0) >= version,
                deadline,
                lambda: (
                    f"version {version} was not checkpointed in time (--durable-acks); newest on disk: "
                    f"{self.last_checkpoint_version}"
                ),
            )

    def _check_counted(self, member: Member, stamp: PushStamp) -> None:
        """Refuse a push of a round the cluster does not count the rank in (shard 0's decision:
        a resize left it out, or, sync, it rejoined from a later round). Caller holds the lock.

        Raises:
            NotJoinedError: a resize left the rank out. StalePushError: sync, a round before the
                rank's first counted one.
        """
        sync = self.policy.holds_pushes
        self.membership.check_in_cluster(member.rank, stamp.clock if sync else None)
        if sync and stamp.clock < member.since:
            raise StalePushError(
                f"Rank {member.rank} counts from round {member.since} (it rejoined; shard 0 decided): round "
                f"{stamp.clock} goes on without it. Pull version {member.since} and push clock {member.since}."
            )

    def pull(
        self,
        rank: int,
        incarnation: int,
        min_version: int,
        digest: str,
        timeout: float | None,
        wire_dtype: str = "",
        encode: Callable[[Snapshot], T] = clone_tensors,  # type: ignore[assignment]
    ) -> tuple[int, T]:
        """Wait until this rank may read (the policy decides), then ``encode`` the parameters.

        sync: waits for version >= ``min_version``. ssp: waits until the slowest live rank's clock
        is >= this rank's clock - s (the clock is the shard's own count of the rank's pushes).
        async and easgd: no wait.

        Args:
            timeout: seconds to wait at most; None waits until the shard closes.
            wire_dtype: checked here (a float narrower than every parameter, or ""); the encoder
                converts.
            encode: called under the lock with the :class:`Snapshot` of the version read; its
                result is returned (by default copies of the tensors).

        Returns:
            (version, ``encode(snapshot)``).

        Raises:
            WaitTimeoutError: not readable in time. ShuttingDownError: closing.
            UpdateRefusedError: sync, the round waited for was refused. PushLostError.
            NotInitializedError, PlanMismatchError, InvalidRequestError, PreconditionError.
        """
        deadline = None if timeout is None else self._now() + timeout
        with self._cond:
            self.check_wire_dtype(self.check_plan(digest), wire_dtype)
            member = self.membership.get(rank, incarnation)
            joined = member.state is WorkerState.LIVE and member.incarnation == incarnation
            if joined:
                self.membership.touch(member)
            self.policy.check_read(self, member, joined, min_version)
            self.wait_for_ranks(
                lambda: self.policy.can_read(self, member, joined, min_version),
                deadline,
                lambda: self.policy.blocked(self, member, min_version, timeout),
            )
            self.policy.after_read(self, member, joined, min_version)
            assert self.store is not None
            if self.store.stepped_slots:  # a streamed round's speculative slots are not a version
                round_stream.end(self, "a read needed the parameters mid-round")  # type: ignore[arg-type]
            return self.version, encode(self._snapshot(self.version, self.store.tensors))

    def push_pull(
        self,
        stamp: PushStamp,
        grad_version: int,
        digest: str,
        partitions: Sequence[WirePartition],
        timeout: float | None,
        encode: Callable[[Snapshot], T],
        wire_dtype: str = "",
        check: Callable[[Plan], None] | None = None,
        hyper: Hyperparameters = (),
        skip: bool = False,
        stream: RoundStream | None = None,
    ) -> tuple[PushResult, int, T]:
        """:meth:`push`, then :meth:`pull` of the version it lands in (one PushPull per training
        step): sync reads version ``clock + 1``, the round the push joined; the others as a pull
        with no minimum version.

        Args:
            encode: as :meth:`pull`.
            check: called under the lock with the plan, after the plan and ``wire_dtype`` checks
                and before the push (PushPullOnce: the response must fit in one message).
            hyper, skip, stream: as :meth:`push`. sync: the result says whether the round was skipped.

        Returns:
            (push result, version, ``encode(snapshot)``).

        Raises:
            Everything :meth:`push`, :meth:`pull` and ``check`` raise; a refused push pulls nothing.
        """
        start = self._now()
        with self._cond:
            plan = self.check_plan(digest)
            self.check_wire_dtype(plan, wire_dtype)
            if check is not None:
                check(plan)
        result = self.push(stamp, grad_version, digest, partitions, hyper, skip, stream)
        policy = POLICIES[result.mode]  # the mode that took the push
        remaining = None if timeout is None else max(0.0, timeout - (self._now() - start))
        min_version = policy.read_after_push(stamp.clock)
        version, out = self.pull(stamp.rank, stamp.incarnation, min_version, digest, remaining, wire_dtype, encode)
        self.wait_durable(version, None if timeout is None else start + timeout)
        if policy.holds_pushes and not result.dropped:
            with self._cond:
                result = dataclasses.replace(result, skipped=stamp.clock in self.skipped_rounds)
        return result, version, out

    def exchange(
        self,
        stamp: PushStamp,
        digest: str,
        partitions: Sequence[WirePartition],
        timeout: float | None,
        encode: Callable[[Snapshot], T] = clone_tensors,  # type: ignore[assignment]
    ) -> tuple[int, T]:
        """EASGD exchange: take the worker's x, return d = alpha (x - center); center += d.

        Async (Algorithm 1): applied at once, atomically. Sync (``easgd_sync``): waits until every
        live rank sent its x for period ``stamp.clock``, then applies them together in rank order.
        A repeated stamp gets the original d and changes nothing.

        Returns:
            (version, ``encode`` of a :class:`Snapshot` whose tensors are d).

        Raises:
            PreconditionError: not in easgd mode, not joined. WaitTimeoutError: sync period not
            complete in time. UpdateRefusedError. InvalidRequestError, NotInitializedError,
            PlanMismatchError.
        """
        deadline = None if timeout is None else self._now() + timeout
        with self._cond:
            plan = self.check_plan(digest)
            self.policy.check_exchange()
            member = self.membership.get(stamp.rank, stamp.incarnation)
            last = member.last_exchange
            if last is not None and last[0] == (stamp.incarnation, stamp.clock):
                return last[1], encode(self._snapshot(last[1], last[2]))
            self.membership.check_live(member, stamp.incarnation)
            self._check_replay(member, stamp, "Exchange")
        x = match_partitions(plan, self.shard_index, partitions, "parameter")
        with self._cond:
            self.membership.check_live(member, stamp.incarnation)
            last = member.last_exchange
            if last is not None and last[0] == (stamp.incarnation, stamp.clock):
                return last[1], encode(self._snapshot(last[1], last[2]))
            self._check_replay(member, stamp, "Exchange")
            version, d = self.policy.exchange(self, member, stamp, x, deadline)
            self._cond.notify_all()
            return version, encode(self._snapshot(version, d))

    def _snapshot(self, version: int, tensors: Sequence[torch.Tensor]) -> Snapshot:
        assert self.store is not None and self.plan is not None
        parts = [(p.key, p.offset, p.length) for p in self.store.partitions]
        return Snapshot(version, self._store_epoch, self.plan, self.shard_index, parts, tensors)

    def _check_replay(self, member: Member, stamp: PushStamp, what: str = "Push") -> None:
        """Refuse a clock at or below the rank's high-water mark (policies that hold pushes for
        their round refuse closed rounds themselves). Caller holds the lock and found no answer.

        Raises:
            ReplayedPushError: counted as ``replayed``.
        """
        if self.policy.holds_pushes:
            return
        try:
            self.membership.check_replay(member, stamp.incarnation, stamp.clock, what)
        except StalePushError:
            self.counters.refuse("replayed")
            raise
