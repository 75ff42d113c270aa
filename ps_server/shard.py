"""The state of one shard: membership, versions, idempotent pushes and waits, under one condition.

The servicer decodes a request and calls one method here; each method validates everything before
it touches state, so a refused request changes nothing. The pure policies in ``ps_server.policy``
decide when and how updates apply; the store applies them.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ps_common import frames
from ps_common.codec import torch_dtype, wire_dtype_allowed
from ps_common.errors import (
    CheckpointError,
    HyperparametersDisagreeError,
    InvalidRequestError,
    NotInitializedError,
    PlanMismatchError,
    PreconditionError,
    PushLostError,
    RanksMissingError,
    ShuttingDownError,
    StalePushError,
    UpdateRefusedError,
    WaitTimeoutError,
)
from ps_common.frames import response_frames
from ps_common.modes import MODES, ModeSettings
from ps_common.optimizer import OptimizerSpec, check_in_range
from ps_common.partition import WirePartition
from ps_common.plan import ParameterSpec, Plan, make_plan, plan_digest
from ps_common.text import quote
from ps_server.core.limits import Limits
from ps_server.core.partitions import match_partitions
from ps_server.membership import Member, Membership, MemberView, PushResult, WorkerState
from ps_server.policy import asynchronous, easgd, ssp
from ps_server.policy.sync import Hyperparameters, SyncRounds, aggregate, agreed_hyperparameters
from ps_server.store import ParameterStore

log = logging.getLogger(__name__)

__all__ = ["MODES", "Shard", "WorkerState", "PushResult", "StatusView", "MemberView"]


@dataclass(frozen=True)
class JoinInfo:
    initialized: bool
    version: int
    plan_digest: str
    clock: int
    optimizer: OptimizerSpec | None = None


@dataclass(frozen=True)
class StatusView:
    """A consistent snapshot of a shard for Admin/GetStatus."""

    shard_index: int
    num_shards: int
    settings: ModeSettings
    lease_timeout: float
    learning_rate: float
    initialized: bool
    version: int
    plan_digest: str
    num_partitions: int
    num_elements: int
    parameter_bytes: int
    optimizer: OptimizerSpec | None
    workers: tuple[MemberView, ...]
    round_ranks: tuple[int, ...]
    round_waiting_for: tuple[int, ...]
    round_age_seconds: float
    pending_mode: str
    max_clock_gap: int
    rejected_pushes: dict[str, int]
    staleness: dict[int, int]
    last_checkpoint_version: int | None = None
    restored_from_version: int | None = None

    @property
    def mode(self) -> str:
        return self.settings.mode

    @property
    def num_workers(self) -> int:
        return self.settings.num_workers


class Shard:
    """Thread-safe state of shard ``shard_index`` of ``num_shards``.

    Args:
        shard_index: this shard, ``0 <= shard_index < num_shards``.
        num_shards: shards in the cluster.
        settings: the consistency model and its parameters (also gives ``num_workers``).
        lease_timeout: seconds of silence after which a live rank is evicted.
        now: monotonic clock in seconds (injected for tests).
        join_timeout: seconds after the first Join after which waits that need a rank that never
            joined fail with RanksMissingError (0: wait for it forever).
        limits: bounds on the plans an Init may declare (defaults of :class:`Limits`).
        checkpoint_every: hand a snapshot to ``on_snapshot`` every ``checkpoint_every`` versions
            (0: never; checkpoints are then written only on demand and at shutdown).
        on_snapshot: called as ``on_snapshot(version, state)`` under the shard's lock with the
            :meth:`export_state` of that version (``Checkpointer.offer``); must not block.
    """

    def __init__(
        self,
        shard_index: int,
        num_shards: int,
        settings: ModeSettings,
        lease_timeout: float = 10.0,
        now: Callable[[], float] = time.monotonic,
        join_timeout: float = 0.0,
        limits: Limits | None = None,
        checkpoint_every: int = 0,
        on_snapshot: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> None:
        self.shard_index = shard_index
        self.limits = limits or Limits()
        self.num_shards = num_shards
        self.settings = settings
        self.num_workers = settings.num_workers
        self.lease_timeout = lease_timeout
        self._now = now
        self._cond = threading.Condition()
        self._closed = False
        self.plan: Plan | None = None
        self.store: ParameterStore | None = None
        self.version = 0
        self.rounds = SyncRounds()
        self.round_opened: float | None = None
        self.round_reported = False
        self.pending_mode = ""
        self.max_clock_gap = 0
        self.rejected: Counter[str] = Counter()
        self.staleness_counts: Counter[int] = Counter()
        self.exchange_results: dict[int, tuple[int, list[torch.Tensor]]] = {}
        # sync round or easgd period refused as a whole: rank -> the refusal it has yet to be told
        self.refusals: dict[int, UpdateRefusedError] = {}
        self.skipped_rounds: dict[int, None] = {}  # the last sync rounds whose step was skipped (ordered)
        self.membership = Membership(self.num_workers, lease_timeout, now, join_timeout)
        self.checkpoint_every = checkpoint_every
        self.on_snapshot = on_snapshot
        self.last_checkpoint_version: int | None = None
        self.restored_from_version: int | None = None
        self._store_epoch = 0
        self._frame_cache: dict[tuple[int, int, str, int], list[bytes]] = {}
        self._groups: dict[tuple[str, str], list[list[int]]] = {}

    @property
    def mode(self) -> str:
        return self.settings.mode

    # ----------------------------------------------------------------- validation helpers
    @property
    def members(self) -> list[Member]:
        return self.membership.members

    def check_rank(self, rank: int) -> None:
        """Raise InvalidRequestError when ``rank`` is out of range."""
        self.membership.get(rank)

    def check_plan(self, digest: str) -> Plan:
        """The plan, when the shard is initialized and ``digest`` is its digest.

        Raises:
            NotInitializedError: not initialized yet. InvalidRequestError: an empty digest.
            PlanMismatchError: another digest.
        """
        return self._check_plan(digest)

    def _check_plan(self, digest: str) -> Plan:
        plan = self.plan
        if plan is None:
            raise NotInitializedError(
                f"Shard {self.shard_index} is not initialized; rank 0 must call Init before pushes and pulls."
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
        return plan

    # ----------------------------------------------------------------- membership
    def join(self, rank: int, num_workers: int, incarnation: int) -> JoinInfo:
        """Register ``rank`` (a higher incarnation replaces the old one).

        Raises:
            InvalidRequestError: rank out of range or num_workers differs from the cluster's.
            PreconditionError: a lower incarnation than one already joined.
        """
        if num_workers != self.num_workers:
            raise InvalidRequestError(
                f"This cluster has num_workers={self.num_workers} but the worker says {num_workers}; "
                "start every worker and shard with the same --num-workers."
            )
        with self._cond:
            member = self.membership.get(rank, incarnation)
            self.membership.joins.start()
            if incarnation != member.incarnation:  # a new process: its clocks start over
                member.high_water = -1
                self.refusals.pop(rank, None)
            if incarnation != member.incarnation or member.state is not WorkerState.LIVE:
                log.info("shard %d: rank %d joined (incarnation %d)", self.shard_index, rank, incarnation)
                if incarnation != member.incarnation and self.mode == "ssp":
                    # a restarted rank resumes at the slowest live clock, so it neither blocks nor races
                    others = [m.clock for m in self.members if m.state is WorkerState.LIVE and m is not member]
                    member.clock = min(others, default=member.clock)
            member.incarnation = incarnation
            member.state = WorkerState.LIVE
            self.membership.touch(member)
            if self.mode == "sync":
                member.clock = self.rounds.round
            self._cond.notify_all()
            return JoinInfo(
                initialized=self.plan is not None,
                version=self.version,
                plan_digest=self.plan.digest if self.plan else "",
                clock=member.clock,
                optimizer=self.store.optimizer_spec if self.store else None,
            )

    def heartbeat(self, rank: int, incarnation: int) -> tuple[int, WorkerState]:
        """Renew ``rank``'s lease; returns (version, state)."""
        with self._cond:
            member = self.membership.get(rank, incarnation)
            if member.state is WorkerState.LIVE and member.incarnation == incarnation:
                self.membership.touch(member)
            return self.version, member.state

    def leave(self, rank: int, incarnation: int) -> int:
        """Stop counting ``rank``; rounds and waits go on without it. Returns the version."""
        with self._cond:
            member = self.membership.get(rank, incarnation)
            if member.incarnation == incarnation and member.state is WorkerState.LIVE:
                member.state = WorkerState.LEFT
                log.info("shard %d: rank %d left", self.shard_index, rank)
                self._advance()
            return self.version

    def evict(self, rank: int) -> tuple[WorkerState, int]:
        """Operator eviction: stop counting ``rank`` now. Returns (previous state, version)."""
        with self._cond:
            member = self.membership.get(rank)
            previous = member.state
            if previous in (WorkerState.LIVE, WorkerState.PENDING):
                member.state = WorkerState.EVICTED
                log.warning("shard %d: rank %d evicted by an operator", self.shard_index, rank)
                self._advance()
            return previous, self.version

    def expire_leases(self) -> list[int]:
        """Evict live ranks silent for longer than the lease timeout and report ranks missing from
        a sync round older than the round timeout; returns the evicted ranks."""
        with self._cond:
            now = self._now()
            evicted = []
            for rank, silent in self.membership.expire():
                evicted.append(rank)
                log.warning(
                    "shard %d: rank %d evicted after %.1f s without a heartbeat", self.shard_index, rank, silent
                )
            timeout = self.settings.round_timeout
            if timeout and self.round_opened is not None and not self.round_reported:
                if now - self.round_opened > timeout:
                    self.round_reported = True
                    self.rejected["round_timeout"] += 1
                    log.warning(
                        "shard %d: round %d open for %.1f s, waiting for ranks %s",
                        self.shard_index,
                        self.rounds.round,
                        now - self.round_opened,
                        self.rounds.waiting_for(self.membership.expected()),
                    )
            if evicted:
                self._advance()
            return evicted

    # ----------------------------------------------------------------- init
    def init_plan(self, specs: Sequence[ParameterSpec], num_shards: int, partition_bytes: int, digest: str) -> Plan:
        """The plan an Init declares, checked cheapest first and built only within :attr:`limits`:
        the shard count, then "already initialized" (the digest alone decides), then the number
        of keys (``len(specs)``, before any spec is read), then the bounds on keys, bytes and
        partitions and the digest (linear in the keys), and only then the plan.

        Returns:
            The declared plan; the shard's own when it is already initialized with ``digest``
            (:meth:`init` is then a no-op).

        Raises:
            InvalidRequestError: num_shards differs, a bound of :attr:`limits` exceeded, the
                digest does not match the specs, bad specs.
            PlanMismatchError: already initialized with another plan.
        """
        if num_shards != self.num_shards:
            raise InvalidRequestError(
                f"Init is for {num_shards} shards but this cluster has {self.num_shards}; "
                "pass every shard's address to the client."
            )
        if self.plan is not None:
            return self._check_plan(digest)
        self.limits.check_plan(specs, partition_bytes)  # the key count first, before any spec is read
        expected = plan_digest(specs, num_shards, partition_bytes)
        if digest != expected:
            raise InvalidRequestError(
                f"Init's plan digest {quote(digest[:12], 12)} does not match its own specs ({expected[:12]}); "
                "the client and server disagree on the plan algorithm: upgrade both to the same release."
            )
        return make_plan(specs, num_shards, partition_bytes)

    def init(
        self,
        specs: Sequence[ParameterSpec],
        num_shards: int,
        partition_bytes: int,
        digest: str,
        optimizer: OptimizerSpec,
        partitions: Sequence[WirePartition],
        plan: Plan | None = None,
    ) -> tuple[bool, int, str]:
        """First writer wins: set the plan, initial values and optimizer.

        Args:
            plan: :meth:`init_plan` of the other arguments, when the caller has it already.

        Returns:
            (applied, version, plan digest). ``applied`` is False when already initialized with
            the same plan (a no-op).

        Raises:
            InvalidRequestError: num_shards differs, digest does not match the specs, a bound of
                :attr:`limits` exceeded, a bad partition or optimizer spec.
            PlanMismatchError: already initialized with another plan.
        """
        plan = plan or self.init_plan(specs, num_shards, partition_bytes, digest)
        with self._cond:
            if self.plan is not None:
                self._check_plan(digest)
                return False, self.version, self.plan.digest
        values = match_partitions(plan, self.shard_index, partitions, "value")
        store = ParameterStore(plan, self.shard_index, values, optimizer)
        with self._cond:
            if self.plan is not None:  # lost a race with another Init
                self._check_plan(digest)
                return False, self.version, self.plan.digest
            self.plan, self.store = plan, store
            self._store_epoch += 1
            log.info(
                "shard %d: initialized with %d partitions (%d bytes), plan %s, optimizer %s",
                self.shard_index,
                len(store.partitions),
                store.num_bytes,
                plan.digest[:12],
                optimizer.name,
            )
            self._cond.notify_all()
            return True, self.version, plan.digest

    # ----------------------------------------------------------------- push / pull
    def push(
        self,
        rank: int,
        incarnation: int,
        clock: int,
        grad_version: int,
        digest: str,
        partitions: Sequence[WirePartition],
        hyper: Hyperparameters = (),
        skip: bool = False,
    ) -> PushResult:
        """Accept ``rank``'s gradients for ``clock``; a repeated (rank, incarnation, clock) is
        answered with the original result and applied once.

        sync: held for round ``clock``, applied when the round closes. async: applied at once,
        refused when too stale. ssp: applied at once. easgd: refused (workers call Exchange).

        Args:
            hyper: per parameter group, the hyperparameters (lr...) of the step this push joins;
                they stay in force after it. sync: the round's ranks must agree, or the round is
                refused (HyperparametersDisagreeError). () keeps the shard's own.
            skip: skip the step (AMP overflow); the gradients are ignored. sync: the round closes
                as usual but applies nothing; async, ssp: the push counts, the version stays.

        Raises:
            InvalidRequestError: bad rank or partitions. NotInitializedError, PlanMismatchError,
            PreconditionError: not initialized, other plan, not joined, easgd mode.
            StalePushError: sync round closed (no quorum), or async staleness above the bound.
        """
        with self._cond:
            plan = self._check_plan(digest)
            member = self.membership.get(rank, incarnation)
            seen = member.history.get((incarnation, clock))
            if seen is not None:
                return PushResult(seen.version, seen.staleness, True, seen.dropped, self.mode)
            self.membership.check_live(member, incarnation)
            self._check_replay(member, incarnation, clock)
            if hyper:
                assert self.store is not None
                self.store.check_hyperparameters(hyper)
        grads = match_partitions(plan, self.shard_index, partitions, "gradient")
        with self._cond:
            self.membership.check_live(member, incarnation)
            seen = member.history.get((incarnation, clock))
            if seen is not None:
                return PushResult(seen.version, seen.staleness, True, seen.dropped, self.mode)
            self._check_replay(member, incarnation, clock)
            result = self._accept(member, incarnation, clock, grad_version, grads, hyper, skip)
            self._advance()
            refusal = self.refusals.pop(rank, None) if result.mode == "sync" and not result.dropped else None
            if refusal is not None:  # this push completed its round, and the round was refused
                raise type(refusal)(str(refusal))
            return result

    def _check_replay(self, member: Member, incarnation: int, clock: int, what: str = "Push") -> None:
        """Async, ssp and easgd: refuse a clock at or below the rank's high-water mark (sync rounds
        refuse closed rounds themselves). Caller holds the lock and found no remembered answer.

        Raises:
            ReplayedPushError: counted as ``replayed``.
        """
        if self.mode == "sync":
            return
        try:
            self.membership.check_replay(member, incarnation, clock, what)
        except StalePushError:
            self.rejected["replayed"] += 1
            raise

    def _record(self, member: Member, incarnation: int, clock: int, result: PushResult) -> None:
        """Account an accepted push (before a snapshot of the version it makes is taken)."""
        member.clock = max(member.clock, clock + 1)
        member.pushes += 1
        self.membership.touch(member)
        self.membership.remember(member, incarnation, clock, result)

    def _refusal(self, exc: UpdateRefusedError, what: str, count: int) -> UpdateRefusedError:
        """Count ``count`` refused pushes and word the refusal of ``what`` for the ranks told."""
        self.rejected[exc.reason.lower()] += count
        log.warning("shard %d: %s refused: %s", self.shard_index, what, exc)
        advice = (
            "push the round again once they agree"
            if isinstance(exc, HyperparametersDisagreeError)
            else "lower the learning rate or clip gradients, then pull and push the next gradient"
        )
        return type(exc)(
            f"Shard {self.shard_index} refused {what} as a whole: {exc} Version {self.version} stands; {advice}."
        )

    def _accept(
        self,
        member: Member,
        incarnation: int,
        clock: int,
        grad_version: int,
        grads: Sequence[torch.Tensor],
        hyper: Hyperparameters = (),
        skip: bool = False,
    ) -> PushResult:
        """Apply or hold one push under the lock, per mode, and account it. Rank 0's pushes carry
        the buffer values (async, ssp: assigned with its step, even a skipped one).

        Raises:
            UpdateRefusedError: async, ssp: the step was refused; nothing changed.
        """
        assert self.store is not None
        mode = self.mode
        if mode == "easgd":
            raise PreconditionError("This cluster runs easgd: workers call Exchange every tau steps, not Push.")
        if mode == "sync":
            if clock < self.rounds.round and self.settings.sync_quorum:
                self.rejected["late"] += 1
                log.info(
                    "shard %d: rank %d's push for closed round %d dropped (quorum %d)",
                    self.shard_index,
                    member.rank,
                    clock,
                    self.settings.sync_quorum,
                )
                result = PushResult(self.version, staleness=self.rounds.round - clock, dropped=True, mode=mode)
            else:
                self.rounds.add(member.rank, clock, grads, hyper, skip)
                self.refusals.pop(member.rank, None)  # it moved on from a refused round
                if self.round_opened is None:
                    self.round_opened, self.round_reported = self._now(), False
                result = PushResult(self.version, mode=mode)
            self._record(member, incarnation, clock, result)
            return result
        tau = asynchronous.staleness(self.version, grad_version)
        buffers = grads if member.rank == 0 and self.store.buffer_index else None
        if skip:  # the rank skipped its step: counted, no step; only rank 0's buffers make a new version
            version = self.version + (buffers is not None)
            result = PushResult(version, staleness=tau, mode=mode, skipped=True)
            self._record(member, incarnation, clock, result)
            self.membership.applied(member, incarnation, clock)
            if buffers is not None:
                self.store.assign_buffers(buffers)
                self._set_version(version)
            return result
        try:
            if mode == "async":
                try:
                    asynchronous.check_staleness(tau, self.settings.max_staleness)
                except StalePushError:
                    self.rejected["stale"] += 1
                    raise
                scale = asynchronous.lr_scale(tau, self.settings.staleness_lr)
                self.store.apply(grads, lr_scale=scale, hyper=hyper, buffers=buffers)
            else:  # ssp: apply at once; reads are bounded instead
                self.store.apply(grads, hyper=hyper, buffers=buffers)
        except UpdateRefusedError as exc:
            raise self._refusal(exc, f"the push of rank {member.rank} clock {clock}", 1) from exc
        self.staleness_counts[tau] += 1
        result = PushResult(self.version + 1, staleness=tau, mode=mode)
        self._record(member, incarnation, clock, result)
        self.membership.applied(member, incarnation, clock)
        self._set_version(self.version + 1)
        return result

    def _set_version(self, version: int) -> None:
        """Advance the version; at every ``checkpoint_every``-th version hand a snapshot to
        ``on_snapshot`` (taken under the lock, so every sync shard snapshots the same rounds)."""
        self.version = version
        if self.checkpoint_every and self.on_snapshot and version % self.checkpoint_every == 0:
            self.on_snapshot(version, self.export_state())

    def export_state(self) -> dict[str, Any]:
        """Everything a restarted shard needs, as plain data ``torch.load(weights_only=True)`` reads:
        plan, parameter tensors (copies), optimizer spec and state, version, mode, members.

        Raises:
            NotInitializedError: nothing to save yet.
        """
        with self._cond:
            if self.plan is None or self.store is None:
                raise NotInitializedError(f"Shard {self.shard_index} has nothing to checkpoint before Init.")
            if self.rounds.pending:
                log.info(
                    "shard %d: snapshot at version %d leaves out the open round's pushes from ranks %s",
                    self.shard_index,
                    self.version,
                    sorted(self.rounds.pending),
                )
            return {
                "plan": {
                    "specs": [[sp.key, list(sp.shape), sp.dtype] for sp in self.plan.specs],
                    "num_shards": self.plan.num_shards,
                    "partition_bytes": self.plan.partition_bytes,
                    "digest": self.plan.digest,
                },
                "tensors": [t.detach().clone() for t in self.store.tensors],
                "optimizer": {
                    "name": self.store.optimizer_spec.name,
                    "kwargs": dict(self.store.optimizer_spec.kwargs),
                    "groups": [[list(keys), dict(kw)] for keys, kw in self.store.optimizer_spec.groups],
                    "buffers": list(self.store.optimizer_spec.buffers),
                },
                "optimizer_state": copy.deepcopy(self.store.optimizer.state_dict()),
                "version": self.version,
                "mode": self.mode,
                "members": self.membership.export(),
            }

    def restore(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`export_state` output: parameters, optimizer state, version and
        members (live ranks get a fresh lease to come back in).

        Raises:
            CheckpointError: the checkpoint belongs to another cluster shape or plan.
        """
        plan_info = state["plan"]
        if plan_info["num_shards"] != self.num_shards or len(state["members"]) != self.num_workers:
            raise CheckpointError(
                f"The checkpoint is of a cluster with {plan_info['num_shards']} shards and {len(state['members'])} "
                f"workers, but this shard runs with {self.num_shards} and {self.num_workers}; start with the same "
                "--num-shards/--num-workers or another --checkpoint-dir."
            )
        specs = [ParameterSpec(k, tuple(shape), dtype) for k, shape, dtype in plan_info["specs"]]
        plan = make_plan(specs, plan_info["num_shards"], plan_info["partition_bytes"])
        if plan.digest != plan_info["digest"]:
            raise CheckpointError(
                "The checkpoint's plan digest does not match its specs; it was written by another release of grpc-ps."
            )
        store = ParameterStore(
            plan,
            self.shard_index,
            state["tensors"],
            OptimizerSpec(
                state["optimizer"]["name"],
                state["optimizer"]["kwargs"],
                tuple((tuple(keys), dict(kw)) for keys, kw in state["optimizer"].get("groups", [])),
                tuple(state["optimizer"].get("buffers", [])),
            ),
        )
        store.optimizer.load_state_dict(state["optimizer_state"])
        with self._cond:
            self.plan, self.store = plan, store
            self._store_epoch += 1
            self.version = int(state["version"])
            self.rounds = SyncRounds(round=self.version)
            self.membership.restore(state["members"])
            self.restored_from_version = self.version
            self.last_checkpoint_version = self.version
            log.info("shard %d: resumed from its checkpoint at version %d", self.shard_index, self.version)
            self._cond.notify_all()

    def _advance(self) -> None:
        """Close a complete sync round, apply a pending mode switch at a round boundary, and wake
        waiters. Caller holds the lock."""
        if self.store is not None and self.mode == "sync":
            held = self.rounds.take_if_complete(self.membership.expected(), self.settings.sync_quorum)
            if held is not None:
                self._close_round(held)
                self.round_opened = None
        if self.store is not None and self.mode == "easgd" and self.settings.easgd_sync:
            held = self.rounds.take_if_complete(self.membership.expected())
            if held is not None:
                try:
                    ds = easgd.exchange_round(self.store.tensors, held, self.settings.moving_rate)
                except UpdateRefusedError as exc:
                    self._refuse_round(held, exc)
                else:
                    for rank, d in ds.items():
                        self.exchange_results[rank] = (self.rounds.round, d)
                    self._set_version(self.rounds.round)
        if self.pending_mode and not self.rounds.pending:
            log.info(
                "shard %d: mode %s -> %s at version %d", self.shard_index, self.mode, self.pending_mode, self.version
            )
            self.settings = self.settings.updated(mode=self.pending_mode)
            self.pending_mode = ""
            self.refusals.clear()  # told only while their rounds are the open ones
            self.rounds = SyncRounds(round=self.version)
            for m in self.members:
                m.clock = max(m.clock, self.version) if self.mode == "sync" else m.clock
        self._cond.notify_all()

    def _close_round(self, held: dict[int, Any]) -> None:
        """Apply the complete sync round ``held`` with the hyperparameters its ranks agree on, skip
        its step when a rank asked to, or refuse it as a whole; either way but the last, the buffer
        partitions take the values of the round's lowest rank (rank 0). Caller holds the lock."""
        assert self.store is not None
        hyper = agreed_hyperparameters(self.rounds.taken_hyper)
        if hyper is None:
            sent = "; ".join(f"rank {r}: {list(h) or 'none'}" for r, h in sorted(self.rounds.taken_hyper.items()))
            self._refuse_round(
                held,
                HyperparametersDisagreeError(
                    f"its ranks sent different hyperparameters ({sent[:400]}); every rank must step the same lr "
                    "scheduler (same schedule, same step count) and send the same param groups."
                ),
            )
            return
        lowest = held[min(held)] if self.store.buffer_index else None
        if self.rounds.taken_skips:
            skippers = sorted(self.rounds.taken_skips)
            if lowest is not None:
                self.store.assign_buffers(lowest)
            log.info(
                "shard %d: round %d skipped (ranks %s asked to)", self.shard_index, self.rounds.round - 1, skippers
            )
            self.skipped_rounds[self.rounds.round - 1] = None
            while len(self.skipped_rounds) > 64:
                del self.skipped_rounds[next(iter(self.skipped_rounds))]
            self._set_version(self.rounds.round)
            return
        try:
            self.store.apply(aggregate(held), hyper=hyper, buffers=lowest)
        except UpdateRefusedError as exc:
            self._refuse_round(held, exc)
        else:
            self._set_version(self.rounds.round)
            log.debug("shard %d: round %d applied", self.shard_index, self.version - 1)

    def _refuse_round(self, held: dict[int, Any], exc: UpdateRefusedError) -> None:
        """The complete round (sync) or period (easgd) ``held`` could not be applied: reopen it
        empty at the same number, forget its pushes (so they may come again), and leave each of its
        ranks the refusal its push or pull will raise. Caller holds the lock; nothing else changed."""
        self.rounds.round -= 1
        error = self._refusal(exc, f"round {self.rounds.round} (ranks {sorted(held)})", len(held))
        for rank in held:
            member = self.members[rank]
            for key in [k for k in member.history if k[1] == self.rounds.round]:
                del member.history[key]
            member.clock = min(member.clock, self.rounds.round)
            self.refusals[rank] = error

    def _wait(self, ready: Callable[[], bool], deadline: float | None, describe: Callable[[], str]) -> None:
        """Wait on the condition until ``ready()``; caller holds the lock.

        Raises:
            ShuttingDownError: the shard is closing. WaitTimeoutError: ``deadline`` passed.
        """
        while not ready():
            if self._closed:
                raise ShuttingDownError(f"Shard {self.shard_index} is shutting down; retry against its restart.")
            remaining = None if deadline is None else deadline - self._now()
            if remaining is not None and remaining <= 0:
                raise WaitTimeoutError(describe())
            self._cond.wait(remaining)

    def _wait_for_ranks(self, ready: Callable[[], bool], deadline: float | None, describe: Callable[[], str]) -> None:
        """:meth:`_wait` for a round or read that needs every expected rank; caller holds the lock.

        Raises:
            RanksMissingError: ranks never joined within the join timeout (see
                :class:`~ps_server.membership.JoinDeadline`), and it is still not ready then.
            ShuttingDownError, WaitTimeoutError: as :meth:`_wait`.
        """
        due = self.membership.joins.due()
        if due is not None and (deadline is None or due < deadline):
            try:
                return self._wait(ready, due, describe)
            except WaitTimeoutError:
                missing = self.report_missing()
                quorum = self.settings.sync_quorum if self.mode == "sync" else 0  # K of N: the others can close rounds
                if missing and not (quorum and len(self.membership.expected()) - len(missing) >= quorum):
                    raise RanksMissingError(self.membership.joins.describe(missing, self.shard_index)) from None
        self._wait(ready, deadline, describe)

    def report_missing(self) -> list[int]:
        """Ranks that never joined within the join timeout; the first time there are some, log them
        and count ``join_timeout`` in the status's refusals (called by the reaper and by waits)."""
        with self._cond:
            missing = self.membership.joins.missing(self.members)
            if missing and not self.membership.joins.reported:
                self.membership.joins.reported = True
                self.rejected["join_timeout"] += 1
                log.error("shard %d: %s", self.shard_index, self.membership.joins.describe(missing, self.shard_index))
            return missing

    def pull(
        self,
        rank: int,
        incarnation: int,
        min_version: int,
        digest: str,
        timeout: float | None,
        wire_dtype: str = "",
        packed: bool = False,
    ) -> tuple[int, list[bytes]]:
        """Wait until this rank may read, then copy out every partition.

        sync: waits for version >= ``min_version``. ssp: waits until the slowest live rank's clock
        is >= this rank's clock - s (the clock is the shard's own count of the rank's pushes).
        async and easgd: no wait.

        Args:
            timeout: seconds to wait at most; None waits until the shard closes.
            wire_dtype: send float32/float64 parameters as this narrower float ("" = as they are).
            packed: pack small partitions together up to ``partition_bytes`` per message
                (PushPull); otherwise one partition per message (Pull).

        Returns:
            (version, encoded messages) in plan order, from one consistent snapshot (see
            :func:`ps_common.frames.response_frames`). Every rank reading the same version with
            the same ``wire_dtype`` and ``packed`` shares one copy of the parameters.

        Raises:
            WaitTimeoutError: not readable in time. ShuttingDownError: closing.
            NotInitializedError, PlanMismatchError, InvalidRequestError, PreconditionError.
        """
        deadline = None if timeout is None else self._now() + timeout
        with self._cond:
            self._check_wire_dtype(self._check_plan(digest), wire_dtype)
            member = self.membership.get(rank, incarnation)
            joined = member.state is WorkerState.LIVE and member.incarnation == incarnation
            if joined:
                self.membership.touch(member)

            clocks = self.membership.clocks

            if self.mode == "sync" and joined and min_version > self.version and rank in self.refusals:
                refusal = self.refusals.pop(rank)  # the round it waits for was refused
                raise type(refusal)(str(refusal))
            round_ = self.rounds.round
            waits_without_its_push = min_version > self.version and (
                member.rank not in self.rounds.pending or min_version > round_ + 1
            )
            if self.mode == "sync" and joined and waits_without_its_push and rank in self.membership.expected():
                raise PushLostError(
                    f"Rank {rank} waits for version {min_version} of shard {self.shard_index}, whose open round "
                    f"{round_} holds no push from it (the shard restarted from an older checkpoint since); "
                    f"push round {round_} again, then pull."
                )

            def ready() -> bool:
                if self.mode == "sync":
                    return self.version >= min_version or (joined and rank in self.refusals)
                if self.mode == "ssp" and joined:
                    return ssp.can_read(member.clock, clocks(), self.settings.staleness)
                return True

            def describe() -> str:
                if self.mode == "ssp":
                    return (
                        f"Rank {rank} at clock {member.clock} may read once every live rank reaches clock "
                        f"{member.clock - self.settings.staleness} (slowest: {ssp.slowest(clocks())}); "
                        "check the slow workers."
                    )
                return (
                    f"Version {min_version} not reached in {timeout:.1f} s (shard {self.shard_index} is at "
                    f"{self.version}; round waits for ranks {self.rounds.waiting_for(self.membership.expected())}); "
                    "check those workers."
                )

            self._wait_for_ranks(ready, deadline, describe)
            if self.mode == "sync" and self.version < min_version and rank in self.refusals:
                refusal = self.refusals.pop(rank)
                raise type(refusal)(str(refusal))
            if self.mode == "ssp" and joined:
                self.max_clock_gap = max(self.max_clock_gap, ssp.read_gap(member.clock, clocks()))
            return self.version, self._snapshot_frames(wire_dtype, packed)

    @staticmethod
    def _check_wire_dtype(plan: Plan, wire_dtype: str) -> None:
        """Raises InvalidRequestError unless ``wire_dtype`` is "" or narrower than every parameter."""
        if not wire_dtype:
            return
        bad = {d for d in plan.dtypes.values() if not wire_dtype_allowed(wire_dtype, d)}
        if bad:
            raise InvalidRequestError(
                f"wire_dtype {wire_dtype} is not narrower than this model's {', '.join(sorted(bad))} "
                "parameters; leave it unset, or pick float16/bfloat16 for float32 models."
            )

    def push_pull(
        self,
        rank: int,
        incarnation: int,
        clock: int,
        grad_version: int,
        digest: str,
        partitions: Sequence[WirePartition],
        timeout: float | None,
        wire_dtype: str = "",
        single: bool = False,
        hyper: Hyperparameters = (),
        skip: bool = False,
    ) -> tuple[PushResult, int, list[bytes]]:
        """:meth:`push`, then :meth:`pull` of the version it lands in, packed (one PushPull call
        per training step instead of a Push and a Pull).

        sync: the pull waits for version ``clock + 1``, the round this push joined; async and
        ssp: as :meth:`pull` with no minimum version.

        Args:
            single: the caller takes exactly one message (PushPullOnce).
            hyper, skip: as :meth:`push`. sync: the result says whether the round was skipped.

        Returns:
            (push result, version, encoded PushPullResponse messages without the push answer).

        Raises:
            Everything :meth:`push` and :meth:`pull` raise; a refused push pulls nothing.
            InvalidRequestError: ``single`` but this shard's partitions need more than one message
                (checked before the push).
        """
        start = self._now()
        with self._cond:
            plan = self._check_plan(digest)
            self._check_wire_dtype(plan, wire_dtype)
            if single and len(self._response_groups(plan, wire_dtype)) > 1:
                raise InvalidRequestError(
                    f"Shard {self.shard_index}'s partitions do not fit in one message of {plan.partition_bytes} "
                    "bytes; call PushPull (a stream) instead of PushPullOnce."
                )
        result = self.push(rank, incarnation, clock, grad_version, digest, partitions, hyper, skip)
        min_version = clock + 1 if result.mode == "sync" else 0
        remaining = None if timeout is None else max(0.0, timeout - (self._now() - start))
        version, frames = self.pull(rank, incarnation, min_version, digest, remaining, wire_dtype, packed=True)
        if result.mode == "sync" and not result.dropped:
            with self._cond:
                result = dataclasses.replace(result, skipped=clock in self.skipped_rounds)
        return result, version, frames

    def _response_groups(self, plan: Plan, wire_dtype: str) -> list[list[int]]:
        """How a PushPull response of this shard packs its partitions (see :func:`frames.pack`)."""
        key = (plan.digest, wire_dtype)
        groups = self._groups.get(key)
        if groups is None:
            owned = plan.owned_by(self.shard_index)
            wire = torch_dtype(wire_dtype) if wire_dtype else None
            itemsizes = [(wire or torch_dtype(plan.dtypes[p.key])).itemsize for p in owned]
            groups = frames.packing([(p.key, p.length) for p in owned], itemsizes, plan.partition_bytes)
            self._groups[key] = groups
        return groups

    def _snapshot_frames(self, wire_dtype: str, packed: bool) -> list[bytes]:
        """The encoded parameters at the current version, built once per version (caller holds
        the lock, so the copy is consistent).

        Raises:
            InvalidRequestError: ``wire_dtype`` is not a float narrower than a parameter's dtype.
        """
        assert self.store is not None and self.plan is not None
        key = (self.version, self._store_epoch, wire_dtype, int(packed))
        cached = self._frame_cache.get(key)
        if cached is not None:
            return cached
        out = response_frames(
            self.version,
            [(p.key, p.offset, p.length) for p in self.store.partitions],
            self.store.tensors,
            torch_dtype(wire_dtype) if wire_dtype else None,
            self._response_groups(self.plan, wire_dtype) if packed else None,
        )
        self._frame_cache = {k: v for k, v in self._frame_cache.items() if k[:2] == key[:2]}
        self._frame_cache[key] = out
        return out

    def exchange(
        self,
        rank: int,
        incarnation: int,
        clock: int,
        digest: str,
        partitions: Sequence[WirePartition],
        timeout: float | None,
    ) -> tuple[int, list[bytes]]:
        """EASGD exchange: take the worker's x, return d = alpha (x - center); center += d.

        Async (Algorithm 1): applied at once, atomically. Sync (``easgd_sync``): waits until every
        live rank sent its x for period ``clock``, then applies them together in rank order. A
        repeated (rank, incarnation, clock) gets the original d and changes nothing.

        Raises:
            PreconditionError: not in easgd mode, not joined. WaitTimeoutError: sync period not
            complete in time. InvalidRequestError, NotInitializedError, PlanMismatchError.
        """
        deadline = None if timeout is None else self._now() + timeout
        with self._cond:
            plan = self._check_plan(digest)
            if self.mode != "easgd":
                raise PreconditionError(f"Exchange is for easgd; this cluster runs {self.mode}: push and pull.")
            member = self.membership.get(rank, incarnation)
            last = member.last_exchange
            if last is not None and last[0] == (incarnation, clock):
                return self._encode(last[1], last[2])
            self.membership.check_live(member, incarnation)
            self._check_replay(member, incarnation, clock, "Exchange")
        x = match_partitions(plan, self.shard_index, partitions, "parameter")
        with self._cond:
            self.membership.check_live(member, incarnation)
            last = member.last_exchange
            if last is not None and last[0] == (incarnation, clock):
                return self._encode(last[1], last[2])
            self._check_replay(member, incarnation, clock, "Exchange")
            assert self.store is not None
            if self.settings.easgd_sync:
                self.exchange_results.pop(rank, None)
                self.rounds.add(rank, clock, [t.clone() for t in x])
                self.refusals.pop(rank, None)
                self._advance()
                self._wait_for_ranks(
                    lambda: rank in self.exchange_results or rank in self.refusals,
                    deadline,
                    lambda: (
                        f"EASGD period {clock} waits for ranks "
                        f"{self.rounds.waiting_for(self.membership.expected())}; check those workers."
                    ),
                )
                if rank in self.refusals:
                    refusal = self.refusals.pop(rank)
                    raise type(refusal)(str(refusal))
                version, d = self.exchange_results.pop(rank)
                self._exchanged(member, incarnation, clock, version, d)
            else:
                try:
                    d = easgd.exchange(self.store.tensors, x, self.settings.moving_rate)
                except UpdateRefusedError as exc:
                    raise self._refusal(exc, f"the exchange of rank {rank} clock {clock}", 1) from exc
                version = self.version + 1
                self._exchanged(member, incarnation, clock, version, d)
                self._set_version(version)
            self._cond.notify_all()
            return self._encode(version, d)

    def _exchanged(self, member: Member, incarnation: int, clock: int, version: int, d: list[torch.Tensor]) -> None:
        """Account an applied exchange (before a snapshot of the version it makes is taken)."""
        member.last_exchange = ((incarnation, clock), version, d)
        self.membership.applied(member, incarnation, clock)
        member.clock = max(member.clock, clock + 1)
        member.pushes += 1
        self.membership.touch(member)

    def _encode(self, version: int, tensors: list[torch.Tensor]) -> tuple[int, list[bytes]]:
        assert self.store is not None
        parts = [(p.key, p.offset, p.length) for p in self.store.partitions]
        return version, response_frames(version, parts, tensors)

    # ----------------------------------------------------------------- admin
    def update_config(self, mode: str = "", learning_rate: float | None = None, **changes: Any) -> ModeSettings:
        """Change mode parameters and the learning rate at once; a mode switch waits for the next
        round boundary (at once when no sync round is open).

        Returns:
            The settings in force (a pending switch shows in :meth:`status`).

        Raises:
            InvalidRequestError: a value out of range, an unknown mode, or a switch into or out of
                easgd; nothing changes.
        """
        with self._cond:
            settings = self.settings.updated(**changes)
            if mode:
                settings.updated(mode=mode)  # validate the switch now
            if learning_rate is not None:
                if not (learning_rate >= 0 and learning_rate < float("inf")):
                    raise InvalidRequestError(f"learning_rate must be a finite number >= 0, got {learning_rate}.")
                if self.store is None or self.plan is None:
                    raise NotInitializedError("Set the learning rate after Init: the optimizer does not exist yet.")
                check_in_range("learning_rate", learning_rate, [torch_dtype(d) for d in self.plan.dtypes.values()])
                for group in self.store.optimizer.param_groups:
                    group["lr"] = learning_rate
            self.settings = settings
            if mode:  # switching back to the mode in force cancels a pending switch
                self.pending_mode = mode if mode != self.mode else ""
            log.info(
                "shard %d: config now %s%s",
                self.shard_index,
                self.settings,
                f", switching to {mode} at the next round boundary" if self.pending_mode else "",
            )
            self._advance()
            return self.settings

    def learning_rate(self) -> float:
        """The optimizer's learning rate in force (0 before Init)."""
        return float(self.store.optimizer.param_groups[0]["lr"]) if self.store else 0.0

    def status(self) -> StatusView:
        """A consistent snapshot for operators."""
        with self._cond:
            now = self._now()
            store = self.store
            expected = self.membership.expected()
            return StatusView(
                shard_index=self.shard_index,
                num_shards=self.num_shards,
                settings=self.settings,
                lease_timeout=self.lease_timeout,
                learning_rate=self.learning_rate(),
                initialized=self.plan is not None,
                version=self.version,
                plan_digest=self.plan.digest if self.plan else "",
                num_partitions=len(store.partitions) if store else 0,
                num_elements=store.num_elements if store else 0,
                parameter_bytes=store.num_bytes if store else 0,
                optimizer=store.optimizer_spec if store else None,
                workers=self.membership.views(),
                round_ranks=tuple(sorted(self.rounds.pending)),
                round_waiting_for=tuple(self.rounds.waiting_for(expected)) if self.rounds.pending else (),
                round_age_seconds=0.0 if self.round_opened is None else now - self.round_opened,
                pending_mode=self.pending_mode,
                max_clock_gap=self.max_clock_gap,
                rejected_pushes=dict(self.rejected),
                staleness=dict(self.staleness_counts),
                last_checkpoint_version=self.last_checkpoint_version,
                restored_from_version=self.restored_from_version,
            )

    def close(self) -> None:
        """Wake every waiter with ShuttingDownError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
