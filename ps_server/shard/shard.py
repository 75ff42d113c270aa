"""The state of one shard: membership, versions, idempotent pushes and waits, under one condition.

The servicer decodes a request and calls one method here; each method validates everything before
it touches state, so a refused request changes nothing. The shard's consistency model
(:data:`ps_server.policy.POLICIES`, by ``settings.mode``) decides what a push does, when a round
closes and when a read is served; the store applies updates. The shard keeps the lock and
condition, the waits, idempotence (the answers of recent pushes, high-water marks, exchange
results) and the membership glue. Reads hand a :class:`Snapshot` to the caller's ``encode`` under
the lock (the service layer encodes and caches the response messages: ``ps_server.service.frame_cache``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ps_common.codec import wire_dtype_allowed
from ps_common.errors import (
    HyperparametersDisagreeError,
    InvalidRequestError,
    NotInitializedError,
    PlanMismatchError,
    UpdateRefusedError,
)
from ps_common.modes import MODES, ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_common.partition import WirePartition
from ps_common.plan import ParameterSpec, Plan, make_plan, plan_digest
from ps_common.tables import TableSpec
from ps_common.text import quote
from ps_proto.v1 import ps_pb2
from ps_server.core.limits import Limits
from ps_server.core.partitions import match_partitions
from ps_server.membership.epochs import Epochs
from ps_server.membership.ranks import Member, Membership, MemberView, PushResult, PushStamp, WorkerState
from ps_server.policy import POLICIES, ConsistencyPolicy
from ps_server.policy.sync import SyncRounds
from ps_server.shard import admin as shard_admin
from ps_server.shard import members as shard_members
from ps_server.shard import state as shard_state
from ps_server.shard.counters import ShardCounters
from ps_server.shard.data import DataPath
from ps_server.shard.round_stream import RoundStream
from ps_server.shard.store import ParameterStore
from ps_server.shard.views import JoinInfo, Snapshot, StatusView
from ps_server.shard.waits import Waits
from ps_server.tables import calls as table_calls
from ps_server.tables.store import TableStore
from ps_server.tables.table import DEFAULT_MAX_TABLE_ROWS

log = logging.getLogger(__name__)

__all__ = ["MODES", "Shard", "WorkerState", "PushResult", "PushStamp", "StatusView", "MemberView", "Snapshot"]

SnapshotHook = Callable[[int, dict[str, Any]], None]
"""Called with (version, :meth:`Shard.export_state` output) under the shard's lock."""


class Shard(DataPath):
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
        checkpoint_every: hand a snapshot to ``on_snapshot`` at every this-many-th version (0: never).
        on_snapshot: called with (version, :meth:`export_state` output) under the lock.
        counters: where refusals are counted (fresh ones by default); Admin and Prometheus read them.
        record_key: the key membership records are signed and checked with (the shards' admin token;
            "" signs nothing, as on a loopback cluster without tokens).
        cluster_id: the cluster's id (``--cluster-id``; "": shard 0 picks one, others pin shard 0's).
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
        on_snapshot: SnapshotHook | None = None,
        counters: ShardCounters | None = None,
        record_key: str = "",
        cluster_id: str = "",
    ) -> None:
        self.shard_index = shard_index
        self.limits = limits or Limits()
        self.num_shards = num_shards
        self.settings = settings
        self.configured_num_workers = settings.num_workers  # --num-workers; a resize changes num_workers
        self.lease_timeout = lease_timeout
        self._now = now
        self._cond = threading.Condition()
        self.waits = Waits(self._cond, now, shard_index)
        self.plan: Plan | None = None
        self.store: ParameterStore | None = None
        self.version = 0
        self.rounds = SyncRounds()
        self.round_opened: float | None = None
        self.round_reported = False
        self.pending_mode = ""
        self.max_clock_gap = 0
        self.counters = counters or ShardCounters()
        self.exchange_results: dict[int, tuple[int, list[torch.Tensor]]] = {}
        # sync round or easgd period refused as a whole: rank -> the refusal it has yet to be told
        self.refusals: dict[int, UpdateRefusedError] = {}
        self.skipped_rounds: dict[int, None] = {}  # the last sync rounds whose step was skipped (ordered)
        self.membership = Membership(settings.num_workers, lease_timeout, now, join_timeout)
        # shard 0 decides; records are signed with the shards' admin token (``record_key``)
        self.epochs = Epochs(
            authority=shard_index == 0, num_workers=settings.num_workers, key=record_key, cluster_id=cluster_id
        )
        self.durable_acks = False  # answer pushes once their version is in a durable checkpoint
        self.stream_rounds = "auto"  # --stream-rounds (ps_server.shard.round_stream)
        self.stream: RoundStream | None = None  # the sync round being streamed (round_stream)
        self.streamed_rounds = 0  # sync rounds stepped slot by slot and closed as streamed
        self.unstreamed_rounds = 0  # streams that ended before their round closed (then applied whole)
        self.refused_at: int | None = None  # the round last refused as a whole (reopened)
        self.checkpoint_every = checkpoint_every
        self.on_snapshot = on_snapshot
        self.last_checkpoint_version: int | None = None
        self.restored_from_version: int | None = None
        self._store_epoch = 0
        self.tables = TableStore(shard_index, num_shards, DEFAULT_MAX_TABLE_ROWS)  # embedding tables (issue 19)

    @property
    def mode(self) -> str:
        return self.settings.mode

    @property
    def policy(self) -> ConsistencyPolicy:
        """The consistency model in force (a mode switch swaps it at a round boundary)."""
        return POLICIES[self.settings.mode]

    @property
    def num_workers(self) -> int:
        """The cluster's worker count in force (``--num-workers`` until a resize)."""
        return self.membership.num_workers

    @property
    def members(self) -> list[Member]:
        return self.membership.members

    def now(self) -> float:
        """The shard's monotonic clock, in seconds."""
        return self._now()

    # ----------------------------------------------------------------- validation
    def check_rank(self, rank: int) -> None:
        """Raise InvalidRequestError when ``rank`` is out of range."""
        self.membership.get(rank)

    def check_live(self, rank: int, incarnation: int) -> None:
        """Raise unless ``rank`` is a live member of this shard under ``incarnation`` (a data
        connection's frames come from members only).

        Raises:
            InvalidRequestError: rank out of range. SupersededError: an older incarnation.
            NotJoinedError: not joined under ``incarnation``, evicted or left.
        """
        with self._cond:
            self.membership.check_live(self.membership.get(rank, incarnation), incarnation)

    def check_plan(self, digest: str) -> Plan:
        """The plan, when the shard is initialized and ``digest`` is its digest.

        Raises:
            NotInitializedError: not initialized yet. InvalidRequestError: an empty digest.
            PlanMismatchError: another digest.
        """
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

    # ----------------------------------------------------------------- membership (shard_members)
    def join(self, rank: int, num_workers: int, incarnation: int, epoch: int = 0) -> JoinInfo:
        """Register ``rank`` (a higher incarnation replaces the old one); see :func:`shard_members.join`."""
        return shard_members.join(self, rank, num_workers, incarnation, epoch)

    def check_session(self, rank: int, incarnation: int, session: int, what: str) -> None:
        """Refuse a push-type request without ``rank``'s current session; see :func:`shard_members.check_session`."""
        shard_members.check_session(self, rank, incarnation, session, what)

    def session_is(self, rank: int, incarnation: int, session: int) -> bool:
        """Whether ``session`` is ``rank``'s current session here under ``incarnation`` (a data
        connection's hello; False for a rank out of range or no session)."""
        with self._cond:
            if not session or not 0 <= rank < len(self.members):
                return False
            member = self.members[rank]
            return member.session == session and member.incarnation == incarnation

    def is_live(self, rank: int, incarnation: int) -> bool:
        """Whether ``rank`` is joined and live here under ``incarnation`` (False for a rank out of
        range): only such a rank's Heartbeat or Leave relays a membership record."""
        with self._cond:
            if not 0 <= rank < len(self.members):
                return False
            member = self.members[rank]
            return member.state is WorkerState.LIVE and member.incarnation == incarnation

    def check_member(self, rank: int, incarnation: int) -> None:
        """A Heartbeat's or Leave's own checks; see :func:`shard_members.check_member`."""
        shard_members.check_member(self, rank, incarnation)

    def heartbeat(self, rank: int, incarnation: int) -> tuple[int, WorkerState]:
        """Renew ``rank``'s lease; returns (version, state)."""
        return shard_members.heartbeat(self, rank, incarnation)

    def leave(self, rank: int, incarnation: int) -> int:
        """Stop counting ``rank``; rounds and waits go on without it. Returns the version."""
        return shard_members.leave(self, rank, incarnation)

    def evict(self, rank: int) -> tuple[WorkerState, int]:
        """Operator eviction: stop counting ``rank`` now. Returns (previous state, version)."""
        return shard_members.evict(self, rank)

    def adopt(self, record: ps_pb2.MembershipEpoch) -> bool:
        """Follow shard 0's membership ``record`` when newer; see :func:`shard_members.adopt`."""
        return shard_members.adopt(self, record)

    def resize(self, num_workers: int, at_version: int | None = None) -> tuple[int, int]:
        """Shard 0: ranks ``0..num_workers-1`` from ``at_version``; see :func:`shard_members.resize`."""
        return shard_members.resize(self, num_workers, at_version)

    def expire_leases(self) -> list[int]:
        """Evict silent live ranks and report an overdue sync round; returns the evicted ranks."""
        return shard_members.expire_leases(self)

    def report_missing(self) -> list[int]:
        """Ranks that never joined within the join timeout (reported once)."""
        return shard_members.report_missing(self)

    # ----------------------------------------------------------------- init
    def init_plan(self, specs: Sequence[ParameterSpec], num_shards: int, partition_bytes: int, digest: str) -> Plan:
        """The plan an Init declares, checked cheapest first and built only within :attr:`limits`:
        the shard count, then "already initialized" (the digest alone decides), then the number
        of keys (``len(specs)``, before any spec is read), then the bounds on keys, bytes and
        partitions and the digest (linear in the keys), and only then the plan.

        Returns:
            The declared plan; the shard's own when it is already initialized with ``digest``.

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
            return self.check_plan(digest)
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
            (applied, version, plan digest); ``applied`` is False when already initialized with
            the same plan (a no-op).

        Raises:
            InvalidRequestError: num_shards differs, digest does not match the specs, a bound of
                :attr:`limits` exceeded, a bad partition or optimizer spec.
            PlanMismatchError: already initialized with another plan.
        """
        plan = plan or self.init_plan(specs, num_shards, partition_bytes, digest)
        with self._cond:
            if self.plan is not None:
                self.check_plan(digest)
                return False, self.version, self.plan.digest
        values = match_partitions(plan, self.shard_index, partitions, "value")
        store = ParameterStore(plan, self.shard_index, values, optimizer)
        with self._cond:
            if self.plan is not None:  # lost a race with another Init
                self.check_plan(digest)
                return False, self.version, self.plan.digest
            self.plan, self.store = plan, store
            self.stream = None
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

    # ----------------------------------------------------------------- the policy's shard (ShardCore)
    def record(self, member: Member, stamp: PushStamp, result: PushResult) -> None:
        """Account an accepted push (before a snapshot of the version it makes is taken)."""
        member.clock = max(member.clock, stamp.clock + 1)
        member.pushes += 1
        self.membership.touch(member)
        self.membership.remember(member, stamp.incarnation, stamp.clock, result)

    def refusal(self, exc: UpdateRefusedError, what: str, count: int) -> UpdateRefusedError:
        """Count ``count`` refused pushes and word the refusal of ``what`` for the ranks told."""
        self.counters.refuse(exc.reason.lower(), count)
        log.warning("shard %d: %s refused: %s", self.shard_index, what, exc)
        advice = (
            "push the round again once they agree"
            if isinstance(exc, HyperparametersDisagreeError)
            else "lower the learning rate or clip gradients, then pull and push the next gradient"
        )
        return type(exc)(
            f"Shard {self.shard_index} refused {what} as a whole: {exc} Version {self.version} stands; {advice}."
        )

    def refuse_round(self, held: dict[int, Any], exc: UpdateRefusedError) -> None:
        """The complete round (sync) or period (easgd) ``held`` could not be applied: reopen it
        empty at the same number, forget its pushes (so they may come again), and leave each of its
        ranks the refusal its push or pull will raise. Caller holds the lock; nothing else changed."""
        self.rounds.round -= 1
        self.refused_at = self.rounds.round  # a change decided now governs the round's retry
        error = self.refusal(exc, f"round {self.rounds.round} (ranks {sorted(held)})", len(held))
        for rank in held:
            member = self.members[rank]
            for key in [k for k in member.history if k[1] == self.rounds.round]:
                del member.history[key]
            member.clock = min(member.clock, self.rounds.round)
            self.refusals[rank] = error

    def set_version(self, version: int) -> None:
        """Advance the version; at every ``checkpoint_every``-th version hand a snapshot to
        ``on_snapshot`` (taken under the lock, so every sync shard snapshots the same rounds)."""
        self.version = version
        self.membership.settle(version)
        shard_admin.apply_due(self)
        if self.checkpoint_every and self.on_snapshot and version % self.checkpoint_every == 0:
            self.on_snapshot(version, self.export_state())

    def notify(self) -> None:
        """Wake every wait on the shard's lock (caller holds it)."""
        self._cond.notify_all()

    def wake(self) -> None:
        """Take the lock and wake every wait on it (a push partition landed on a data connection)."""
        with self._cond:
            self._cond.notify_all()

    def values_key(self) -> tuple[int, int]:
        """(version, store epoch) now: the parameters' values are the same while both are."""
        with self._cond:
            return self.version, self._store_epoch

    def advance(self) -> None:
        """Let the policy close a complete round or period, switch a pending mode at a round
        boundary (the new policy takes over), and wake waiters. Caller holds the lock."""
        self.policy.advance(self)
        if self.pending_mode and not self.rounds.pending:
            log.info(
                "shard %d: mode %s -> %s at version %d", self.shard_index, self.mode, self.pending_mode, self.version
            )
            self.settings = self.settings.updated(mode=self.pending_mode)
            self.pending_mode = ""
            self.refusals.clear()  # told only while their rounds are the open ones
            self.rounds = SyncRounds(round=self.version)
            self.policy.on_switch(self)
        self._cond.notify_all()

    def wait_for_ranks(self, ready: Callable[[], bool], deadline: float | None, describe: Callable[[], str]) -> None:
        """Wait for a round or read that needs every expected rank; caller holds the lock.

        Raises:
            RanksMissingError: ranks never joined within the join timeout (see
                :class:`~ps_server.membership.ranks.JoinDeadline`), and it is still not ready then.
            ShuttingDownError: closing. WaitTimeoutError: ``deadline`` passed.
        """
        quorum = lambda: self.policy.quorum(self.settings)  # noqa: E731
        self.waits.for_ranks(ready, deadline, describe, self.membership, self.report_missing, quorum)

    # ----------------------------------------------------------------- checkpoints
    def checkpointed(self, version: int) -> None:
        """The newest checkpoint on disk is at ``version``: wake the answers waiting for it (``durable_acks``)."""
        with self._cond:
            self.last_checkpoint_version = version
            self._cond.notify_all()

    def export_state(self) -> dict[str, Any]:
        """Everything a restarted shard needs, as plain data; see :func:`shard_state.snapshot`.

        Raises:
            NotInitializedError: nothing to save yet.
        """
        return shard_state.snapshot(self)

    def restore(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`export_state` output; see :func:`shard_state.resume`.

        Raises:
            CheckpointError: the checkpoint belongs to another cluster shape or plan.
        """
        shard_state.resume(self, state)

    # ----------------------------------------------------------------- admin (shard_admin)
    def update_config(self, mode: str = "", learning_rate: float | None = None, **changes: Any) -> ModeSettings:
        """Change mode parameters and the learning rate at once; see :func:`shard_admin.update_config`."""
        return shard_admin.update_config(self, mode, learning_rate, **changes)

    def learning_rate(self) -> float:
        """The optimizer's learning rate in force (0 before Init)."""
        return float(self.store.optimizer.param_groups[0]["lr"]) if self.store else 0.0

    def status(self) -> StatusView:
        """A consistent snapshot for operators."""
        return shard_admin.status(self)

    def close(self) -> None:
        """Wake every waiter with ShuttingDownError."""
        with self._cond:
            self.waits.close()

    # ----------------------------------------------------------------- embedding tables (ps_server.tables.calls)
    def init_tables(
        self, rank: int, incarnation: int, specs: Sequence[TableSpec], remaining: float | None
    ) -> tuple[bool, int, int, list[TableSpec]]:
        """InitTables; see :func:`table_calls.init_tables`."""
        with self._cond:
            return table_calls.init_tables(self, rank, incarnation, specs, remaining)

    def pull_rows(
        self,
        rank: int,
        incarnation: int,
        blocks: Sequence[table_calls.Block],
        min_version: int,
        remaining: float | None,
        reader: Callable[[table_calls.ReadRows], Any],
    ) -> Any:
        """PullRows: check and wait (:func:`table_calls.check_pull`), then hand the read
        (:func:`table_calls.read_rows`, a chunk per hold of the lock) to ``reader``; returns its result."""
        with self._cond:
            table_calls.check_pull(self, rank, incarnation, blocks, min_version, remaining)
        return reader(lambda: table_calls.read_rows(self._cond, self.tables, blocks, self.num_shards))

    def push_rows(
        self, rank: int, incarnation: int, session: int, clock: int, blocks: Sequence[table_calls.Block]
    ) -> tuple[int, bool]:
        """PushRows; see :func:`table_calls.push_rows`. Returns (version, duplicate)."""
        self.check_session(rank, incarnation, session, "PushRows")
        ids = table_calls.decode_push(blocks)
        with self._cond:
            return table_calls.push_rows(self, rank, incarnation, clock, blocks, ids)
