"""The data path of a shard (:class:`DataPath`): Push, Pull, PushPull and Exchange, their checks and
their bookkeeping (idempotence, refusals, durable answers).

Each call checks everything before it touches state, answers a repeated :class:`PushStamp` with the
original answer (idempotence), and leaves the decision to the shard's consistency policy: what a
push does (:meth:`~ps_server.policy.base.ConsistencyPolicy.accept`), when a read is served
(``check_read``/``can_read``/``blocked``/``after_read``) and how an exchange applies. A read hands
the caller's ``encode`` a :class:`~ps_server.shard.views.Snapshot` under the lock.

A push is matched to the plan before the lock (the plan is fixed once set) and checked and applied in
one hold of it (:meth:`DataPath.push`); an exchange runs in two steps under the lock, with the
decoding of its tensors between them (:class:`~ps_server.shard.data_calls.DataCalls` takes the lock
for each): ``admit_exchange`` checks and finds a repeated stamp's answer, ``apply_exchange`` checks
again and applies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from ps_common import tracing
from ps_common.codec import wire_dtype_allowed
from ps_common.errors import (
    HyperparametersDisagreeError,
    InvalidRequestError,
    NotInitializedError,
    PlanMismatchError,
    PreconditionError,
    StalePushError,
    UpdateRefusedError,
)
from ps_common.fragments import check_fragments, fragments_in_force
from ps_common.plan import ParameterSpec, Plan, make_plan, plan_digest
from ps_common.text import quote
from ps_server.core.limits import Limits
from ps_server.membership.ranks import Member, Membership, PushResult, PushStamp, WorkerState
from ps_server.policy.base import ShardCore
from ps_server.shard.round_stream import RoundStreams
from ps_server.shard.views import Snapshot
from ps_server.shard.waits import Waits

T = TypeVar("T")

log = logging.getLogger(__name__)


class DataHost(ShardCore, Protocol):
    """What :class:`DataPath` uses of the shard besides what its policy does (``ShardCore``)."""

    num_shards: int
    limits: Limits
    refused_at: int | None
    waits: Waits
    streams: RoundStreams
    last_checkpoint_version: int | None


class DataPath:
    """Push, Pull, PushPull and Exchange of one shard, and the store's epoch (new at every Init and
    restore). Every method assumes the caller holds the shard's lock (the waits release it while
    they wait); none takes it. ``host``: the shard, read and changed as :class:`DataHost` says."""

    def __init__(self, host: DataHost) -> None:
        self._host = host
        self.store_epoch = 0

    # ----------------------------------------------------------------- plans
    def check_plan(self, digest: str, wire_dtype: str = "") -> Plan:
        """The plan, when the shard is initialized, ``digest`` is its digest and ``wire_dtype`` fits
        it (:meth:`check_wire_dtype`); reads one attribute: no lock needed (the plan is fixed once set).

        Raises:
            NotInitializedError: not initialized yet. InvalidRequestError: an empty digest, a wire
            dtype wider than a parameter. PlanMismatchError: another digest.
        """
        host = self._host
        plan = host.plan
        if plan is None:
            raise NotInitializedError(
                f"Shard {host.shard_index} is not initialized; rank 0 must call Init before pushes and pulls."
            )
        if not digest:
            raise InvalidRequestError(
                "The request's plan_digest is empty; send the digest of the plan (JoinResponse.plan_digest, "
                "or PSClient's, which always sends it)."
            )
        if digest != plan.digest:
            raise PlanMismatchError(
                f"Plan digest {quote(digest[:12], 12)} does not match this shard's {plan.digest[:12]}; "
                "every worker must build the same model with the same num_shards and partition_bytes."
            )
        self.check_wire_dtype(plan, wire_dtype)
        return plan

    @staticmethod
    def check_wire_dtype(plan: Plan, wire_dtype: str) -> None:
        """Raises InvalidRequestError unless ``wire_dtype`` is "" or narrower than every parameter."""
        if not wire_dtype:
            return
        bad = {d for d in plan.dtypes.values() if not wire_dtype_allowed(wire_dtype, d)}
        if bad:
            raise InvalidRequestError(
                f"wire_dtype {wire_dtype} is not narrower than this model's {', '.join(sorted(bad))} "
                "parameters; leave it unset, or pick float16/bfloat16 for float32 models."
            )

    def init_plan(self, specs: Sequence[ParameterSpec], num_shards: int, partition_bytes: int, digest: str) -> Plan:
        """The plan an Init declares, checked cheapest first and built only within the host's
        ``limits``: the shard count, then "already initialized" (the digest alone decides), then the
        number of keys (``len(specs)``, before any spec is read), then the bounds on keys, bytes and
        partitions and the digest (linear in the keys), and only then the plan.

        Returns:
            The declared plan; the shard's own when it is already initialized with ``digest``.

        Raises:
            InvalidRequestError: num_shards differs, a bound of ``limits`` exceeded, the digest does
                not match the specs, bad specs, fewer parameters than diloco's ``--fragments``.
            PlanMismatchError: already initialized with another plan.
        """
        host = self._host
        if num_shards != host.num_shards:
            raise InvalidRequestError(
                f"Init is for {num_shards} shards but this cluster has {host.num_shards}; "
                "pass every shard's address to the client."
            )
        if host.plan is not None:
            return self.check_plan(digest)
        host.limits.check_plan(specs, partition_bytes, num_shards)  # the key count first, before any spec is read
        expected = plan_digest(specs, num_shards, partition_bytes)
        if digest != expected:
            raise InvalidRequestError(
                f"Init's plan digest {quote(digest[:12], 12)} does not match its own specs ({expected[:12]}); "
                "the client and server disagree on the plan algorithm: upgrade both to the same release."
            )
        plan = make_plan(specs, num_shards, partition_bytes)
        check_fragments(plan, fragments_in_force(host.settings))  # diloco: each fragment holds a parameter
        return plan

    def initialized(self, digest: str) -> tuple[bool, int, str]:
        """An Init of an initialized shard: (False, version, plan digest) when ``digest`` is its plan's;
        else PlanMismatchError (another plan) or InvalidRequestError (an empty digest)."""
        plan = self.check_plan(digest)
        return False, self._host.version, plan.digest

    # ----------------------------------------------------------------- pushes
    def repeated(self, member: Member, stamp: PushStamp) -> PushResult | None:
        """The original answer when ``member`` pushed ``stamp`` already (idempotence), else None."""
        seen = member.history.get((stamp.incarnation, stamp.clock))
        return None if seen is None else PushResult(seen.version, seen.staleness, True, seen.dropped, self._host.mode)

    def push(
        self,
        stamp: PushStamp,
        grad_version: int,
        grads: Sequence[torch.Tensor],
        hyper: Any,
        skip: bool,
        stream: Any,
    ) -> tuple[PushResult, bool]:
        """A push whose partitions were matched to the plan (:func:`~ps_server.core.partitions.match_partitions`):
        checked once (repeat, liveness, shutdown, replay, counted, hyperparameters), then handed to the policy,
        which applies (async, ssp), holds (sync) or refuses it; a repeated ``stamp`` is answered as the first time.

        Args:
            grad_version: the version the gradients were computed on (async staleness).
            grads: one 1-D tensor per partition of the shard, in plan order (the store's dtypes).
            hyper: per parameter group, the hyperparameters (lr...) of the step this push joins;
                they stay in force after it. sync: the round's ranks must agree, or the round is
                refused (HyperparametersDisagreeError). () keeps the shard's own.
            skip: skip the step (AMP overflow); the gradients are ignored. sync: the round closes
                as usual but applies nothing; async, ssp: the push counts, the version stays.
            stream: sync, the streamed round this push's partitions were stepped in
                (:mod:`ps_server.shard.round_stream`); None: any stream of the round cannot stand for it.

        Returns:
            (result, whether its answer waits until its version is durable: a push applied now,
            not a held one nor a repeat).

        Raises:
            NotJoinedError, PreconditionError: not joined, counted out, easgd mode, a lost round.
            StalePushError: sync round closed (no quorum), async staleness above the bound, or a replayed
            clock. HyperparametersDisagreeError: bad ``hyper``. UpdateRefusedError: the update (or its
            round) was refused. ShuttingDownError: closing.
        """
        host = self._host
        member = host.membership.get(stamp.rank, stamp.incarnation)
        seen = self.repeated(member, stamp)
        if seen is not None:
            return seen, False
        host.membership.check_live(member, stamp.incarnation, stamp.clock)
        host.waits.check_open()  # ShuttingDownError: nothing is applied after the final checkpoint
        self.check_replay(member, stamp)
        self.check_counted(member, stamp)
        if hyper:
            assert host.store is not None
            host.store.check_hyperparameters(hyper)
        policy = host.policy
        result = policy.accept(host, member, stamp, grad_version, grads, hyper, skip)
        held = policy.holds_pushes and not result.dropped
        if held:
            host.streams.held(stamp.rank, stream)
        host.advance()
        refusal = host.refusals.pop(stamp.rank, None) if held else None
        if refusal is not None:  # this push completed its round, and the round was refused
            raise type(refusal)(str(refusal))
        return result, not policy.holds_pushes

    def record(self, member: Member, stamp: PushStamp, result: PushResult) -> None:
        """Account an accepted push (before a snapshot of the version it makes is taken)."""
        member.clock = max(member.clock, stamp.clock + 1)
        member.pushes += 1
        self._host.membership.touch(member)
        self._host.membership.remember(member, stamp.incarnation, stamp.clock, result)

    def refusal(self, exc: UpdateRefusedError, what: str, count: int) -> UpdateRefusedError:
        """Count ``count`` refused pushes and word the refusal of ``what`` for the ranks told."""
        host = self._host
        host.counters.refuse(exc.reason.lower(), count)
        log.warning("shard %d: %s refused: %s", host.shard_index, what, exc)
        advice = (
            "push the round again once they agree"
            if isinstance(exc, HyperparametersDisagreeError)
            else "lower the learning rate or clip gradients, then pull and push the next gradient"
        )
        return type(exc)(
            f"Shard {host.shard_index} refused {what} as a whole: {exc} Version {host.version} stands; {advice}."
        )

    def refuse_round(self, held: dict[int, Any], exc: UpdateRefusedError) -> None:
        """The complete round (sync) or period (easgd) ``held`` could not be applied: reopen it
        empty at the same number, forget its pushes (so they may come again), and leave each of its
        ranks the refusal its push or pull will raise. Nothing else changed."""
        host = self._host
        host.rounds.round -= 1
        host.refused_at = host.rounds.round  # a change decided now governs the round's retry
        error = self.refusal(exc, f"round {host.rounds.round} (ranks {sorted(held)})", len(held))
        for rank in held:
            member = host.membership.members[rank]
            for key in [k for k in member.history if k[1] == host.rounds.round]:
                del member.history[key]
            member.clock = min(member.clock, host.rounds.round)
            host.refusals[rank] = error

    def wait_durable(self, version: int, deadline: float | None) -> None:
        """With ``durable_acks``: wait until ``version`` is in a checkpoint on disk (the checkpointer
        writes every version), so the answer about to be sent survives a kill -9 of the shard.

        Raises:
            WaitTimeoutError: not durable by ``deadline``. ShuttingDownError: closing.
        """
        host = self._host
        host.waits.until(
            lambda: (host.last_checkpoint_version or 0) >= version,
            deadline,
            lambda: (
                f"version {version} was not checkpointed in time (--durable-acks); newest on disk: "
                f"{host.last_checkpoint_version}"
            ),
        )

    def check_counted(self, member: Member, stamp: PushStamp) -> None:
        """Refuse a push of a round the cluster does not count the rank in (shard 0's decision: a
        resize left it out; sync: it rejoined from a later round), or any push once a round is lost.

        Raises:
            NotJoinedError: a resize left the rank out. StalePushError: sync, a round before the rank's
            first counted one. PreconditionError: ``lost_round`` (ps_server.shard.atomic_rounds).
        """
        host, clock = self._host, stamp.clock
        if host.lost_round:
            raise PreconditionError(host.lost_round)
        sync = host.policy.holds_pushes
        host.membership.check_in_cluster(member.rank, clock if sync else None)
        if sync and clock < member.since and not Membership.counts_old_push(member, stamp.incarnation, clock):
            raise StalePushError(
                f"Rank {member.rank} counts from round {member.since} (it rejoined; shard 0 decided): round "
                f"{clock} goes on without it. Pull version {member.since} and push clock {member.since}."
            )

    def check_replay(self, member: Member, stamp: PushStamp, what: str = "Push") -> None:
        """Refuse a clock at or below the rank's high-water mark (policies that hold pushes for
        their round refuse closed rounds themselves); the caller found no answer to repeat.

        Raises:
            ReplayedPushError: counted as ``replayed``.
        """
        if self._host.policy.holds_pushes:
            return
        try:
            self._host.membership.check_replay(member, stamp.incarnation, stamp.clock, what)
        except StalePushError:
            self._host.counters.refuse("replayed")
            raise

    # ----------------------------------------------------------------- reads
    def read(
        self,
        rank: int,
        incarnation: int,
        min_version: int,
        deadline: float | None,
        timeout: float | None,
        encode: Callable[[Snapshot], T],
    ) -> tuple[int, T]:
        """A Pull: wait until this rank may read (the policy decides), then ``encode`` the parameters.

        sync: waits for version >= ``min_version``. ssp: waits until the slowest live rank's clock
        is >= this rank's clock - s (the clock is the shard's own count of the rank's pushes).
        async and easgd: no wait.

        Args:
            deadline: the shard's clock (seconds) to wait until; ``timeout``, for the message.
            encode: called with the :class:`Snapshot` of the version read; its result is returned.

        Raises:
            AwaitingRanksError: not readable by the call's deadline, and the ranks it waits for are
                alive (the worker calls again). WaitTimeoutError: not readable in time.
            ShuttingDownError: closing. UpdateRefusedError: sync, the round waited for was refused. PushLostError.
            InvalidRequestError, PreconditionError. The caller checked the plan and the wire dtype
            (:meth:`check_plan`).
        """
        host = self._host
        member = host.membership.get(rank, incarnation)
        joined = member.state is WorkerState.LIVE and member.incarnation == incarnation
        if joined:
            host.membership.touch(member)
        host.policy.check_read(host, member, joined, min_version)
        with tracing.span("round_wait", mode=host.mode, min_version=min_version, version=host.version):
            host.wait_for_ranks(  # sync: the round; ssp: the staleness bound; async: no wait
                lambda: host.policy.can_read(host, member, joined, min_version),
                deadline,
                lambda: host.policy.blocked(host, member, min_version, timeout),
                lambda: host.policy.awaited(host, member, min_version),
            )
        host.policy.after_read(host, member, joined, min_version)
        assert host.store is not None
        if host.store.stepped_slots:  # a streamed round's speculative slots are not a version
            host.streams.end("a read needed the parameters mid-round")
        return host.version, encode(self.snapshot(host.version, host.store.tensors))

    def snapshot(self, version: int, tensors: Sequence[torch.Tensor]) -> Snapshot:
        """The :class:`Snapshot` of ``tensors`` (one per partition, plan order) at ``version``."""
        host = self._host
        assert host.store is not None and host.plan is not None
        parts = [(p.key, p.offset, p.length) for p in host.store.partitions]
        return Snapshot(version, self.store_epoch, host.plan, host.shard_index, parts, tensors)

    # ----------------------------------------------------------------- exchanges
    def admit_exchange(
        self, stamp: PushStamp, digest: str, encode: Callable[[Snapshot], T]
    ) -> tuple[Plan, Member, tuple[int, T] | None]:
        """An Exchange's checks before its parameters are decoded: (plan, member, the original
        answer when ``stamp`` was exchanged already, else None).

        Raises:
            PreconditionError: not in easgd mode, not joined. InvalidRequestError,
            NotInitializedError, PlanMismatchError.
        """
        host = self._host
        plan = self.check_plan(digest)
        host.policy.check_exchange()
        member = host.membership.get(stamp.rank, stamp.incarnation)
        answer = self._repeated_exchange(member, stamp, encode)
        if answer is None:
            host.membership.check_live(member, stamp.incarnation)
            self.check_replay(member, stamp, "Exchange")
        return plan, member, answer

    def apply_exchange(
        self,
        member: Member,
        stamp: PushStamp,
        x: Sequence[torch.Tensor],
        deadline: float | None,
        encode: Callable[[Snapshot], T],
    ) -> tuple[int, T]:
        """Check the exchange again and let the policy apply it: take the worker's x, return
        d = alpha (x - center); center += d. Async (Zhang et al. 2015, Algorithm 1): applied at once.
        Sync (``easgd_sync``): waits until every live rank sent its x for period ``stamp.clock``,
        then applies them together in rank order. Returns (version, ``encode`` of d).

        Raises:
            WaitTimeoutError: sync period not complete by ``deadline``. UpdateRefusedError.
            ShuttingDownError: the shard is closing.
        """
        host = self._host
        host.membership.check_live(member, stamp.incarnation)
        answer = self._repeated_exchange(member, stamp, encode)
        if answer is not None:
            return answer
        host.waits.check_open()  # ShuttingDownError: nothing is applied after the final checkpoint
        self.check_replay(member, stamp, "Exchange")
        version, d = host.policy.exchange(host, member, stamp, x, deadline)
        host.notify()
        return version, encode(self.snapshot(version, d))

    def _repeated_exchange(
        self, member: Member, stamp: PushStamp, encode: Callable[[Snapshot], T]
    ) -> tuple[int, T] | None:
        last = member.last_exchange
        if last is not None and last[0] == (stamp.incarnation, stamp.clock):
            return last[1], encode(self.snapshot(last[1], last[2]))
        return None
