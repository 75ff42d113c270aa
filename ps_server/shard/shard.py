"""One shard's state behind one condition: the facade that alone takes the shard's lock.

The servicer decodes a request and calls one method here; each takes the lock and calls the
collaborators that own the state, whose methods assume the lock is held and never take it:
:class:`~ps_server.shard.members.ShardMembers` (ranks, membership epochs),
:class:`~ps_server.shard.relay.MembershipRelay` (membership requests and the records they relay),
:class:`~ps_server.shard.admin.ConfigChanges` (configuration changes, status),
:class:`~ps_server.shard.data.DataPath` (push, pull, exchange, their bookkeeping),
:class:`~ps_server.shard.state.StateCodec` (checkpoint state),
:class:`~ps_server.shard.round_stream.RoundStreams` (streamed sync rounds),
:class:`~ps_server.shard.optimizer_state.OptimizerStates` (the optimizer state in torch's layout), the
:class:`~ps_server.shard.store.ParameterStore` and the :class:`~ps_server.tables.store.TableStore`.
:class:`~ps_server.shard.data_calls.DataCalls` (Push, Pull, PushPull, Exchange) and
:class:`~ps_server.tables.calls.TableCalls` (InitTables, PullRows, PushRows) take the lock in
phases, leaving out of it the work that needs no shared state (matching partitions, decoding ids).
The shard's consistency model (:data:`ps_server.policy.POLICIES`, by ``settings.mode``) decides
what a push does, when a round closes and when a read is served; the shard is the
:class:`~ps_server.policy.base.ShardCore` it is given, and keeps the round state it reads. Reads
hand a :class:`Snapshot` to the caller's ``encode`` under the lock (``service/frame_cache``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Concatenate

import torch

from ps_common.errors import UpdateRefusedError
from ps_common.modes import MODES, ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_common.partition import WirePartition
from ps_common.plan import ParameterSpec, Plan
from ps_server.core.limits import Limits
from ps_server.core.partitions import match_partitions
from ps_server.membership.epochs import Epochs
from ps_server.membership.ranks import Member, Membership, MemberView, PushResult, PushStamp, WorkerState
from ps_server.policy import POLICIES, ConsistencyPolicy
from ps_server.policy.sync import SyncRounds
from ps_server.policy.types import Awaited
from ps_server.shard.admin import ConfigChanges
from ps_server.shard.clipping import RoundClips
from ps_server.shard.counters import ShardCounters
from ps_server.shard.data import DataPath
from ps_server.shard.data_calls import DataCalls
from ps_server.shard.delegation import C, P, R, delegated, locked, part_property
from ps_server.shard.members import ShardMembers
from ps_server.shard.optimizer_state import OptimizerStates
from ps_server.shard.relay import MembershipRelay
from ps_server.shard.round_stream import RoundStream, RoundStreams
from ps_server.shard.state import StateCodec
from ps_server.shard.store import ParameterStore
from ps_server.shard.views import Snapshot, StatusView
from ps_server.shard.waits import Waits
from ps_server.tables.calls import TableCalls
from ps_server.tables.store import TableStore
from ps_server.tables.table import DEFAULT_MAX_TABLE_ROWS

log = logging.getLogger(__name__)

__all__ = ["MODES", "Shard", "WorkerState", "PushResult", "PushStamp", "StatusView", "MemberView", "Snapshot"]

SnapshotHook = Callable[[int, dict[str, Any]], None]
"""Called with (version, :meth:`Shard.export_state` output) under the shard's lock."""


def _lock(self: Shard) -> threading.Condition:
    """The shard's lock (for :func:`_locked`; nothing outside this module takes it)."""
    return self._cond


def _locked(part: str, method: Callable[Concatenate[C, P], R]) -> Callable[Concatenate[Shard, P], R]:
    """``method`` of the shard's collaborator ``part``, called under the shard's lock."""
    return locked(_lock, part, method)


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
        self.shard_index, self.num_shards = shard_index, num_shards
        self.limits = limits or Limits()
        self.settings = settings
        self.lease_timeout = lease_timeout
        self._now = now
        self._cond = threading.Condition()
        self.waits = Waits(self._cond, now, shard_index)
        self.counters = counters or ShardCounters()
        self.checkpoint_every, self.on_snapshot = checkpoint_every, on_snapshot
        # the round state the consistency policy reads and changes (ShardCore)
        self.plan: Plan | None = None
        self.store: ParameterStore | None = None
        self.version = 0
        self.rounds = SyncRounds()
        self.round_opened: float | None = None
        self.round_reported = False
        self.max_clock_gap = 0
        self.exchange_results: dict[int, tuple[int, list[torch.Tensor]]] = {}
        # sync round or easgd period refused as a whole: rank -> the refusal it has yet to be told
        self.refusals: dict[int, UpdateRefusedError] = {}
        self.skipped_rounds: dict[int, None] = {}  # the last sync rounds whose step was skipped (ordered)
        self.refused_at: int | None = None  # the round last refused as a whole (reopened)
        self.lost_round = ""  # sync: why it takes no push any more (ps_server.shard.atomic_rounds.lose)
        # streamed sync rounds (ps_server.shard.round_stream)
        self.stream_rounds = "auto"  # --stream-rounds
        self.stream: RoundStream | None = None  # the sync round being streamed
        self.streamed_rounds = 0  # sync rounds stepped slot by slot and closed as streamed
        self.unstreamed_rounds = 0  # streams that ended before their round closed (then applied whole)
        self.restored_from_version: int | None = None
        self.tables = TableStore(shard_index, num_shards, DEFAULT_MAX_TABLE_ROWS)  # embedding tables
        # the collaborators: each owns its state; their methods run under this shard's lock
        self.cluster = ShardMembers(
            self, shard_index, settings, lease_timeout, now, join_timeout, record_key, cluster_id
        )
        self.relay = MembershipRelay(self, self.cluster)
        self.config = ConfigChanges(self, self.cluster)
        self.data = DataPath(self)
        self.codec = StateCodec(shard_index, num_shards)
        self.streams = RoundStreams(self, self._cond)
        self.table_calls = TableCalls(self, self._cond)
        self.data_calls = DataCalls(self, self._cond)
        self.clips = RoundClips(self)
        self.optimizer_states = OptimizerStates(self)

    # ----------------------------------------------------------------- views of the collaborators' state
    @property
    def mode(self) -> str:
        return self.settings.mode

    @property
    def policy(self) -> ConsistencyPolicy:
        """The consistency model in force (a mode switch swaps it at a round boundary)."""
        return POLICIES[self.settings.mode]

    membership: Membership = part_property("cluster", "membership", "The shard's ranks (:class:`ShardMembers`).")
    epochs: Epochs = part_property("cluster", "epochs", "Shard 0's membership records (:class:`ShardMembers`).")
    configured_num_workers: int = part_property("cluster", "configured_num_workers", "``--num-workers``.")
    pending_mode: str = part_property("config", "pending_mode", "The mode switched to at the next round boundary.")
    durable_acks: bool = part_property("data", "durable_acks", "Answer pushes once their version is durable.", True)
    last_checkpoint_version: int | None = part_property("data", "last_checkpoint_version", "The newest on disk.")

    @property
    def redo_from(self) -> int | None:
        """The newest checkpoint, when a kill -9 can lose answered rounds (periodic checkpoints without
        durable acks): workers keep their pushes from there on (``ps_worker/redo.py``); else None."""
        return None if not self.checkpoint_every or self.durable_acks else self.last_checkpoint_version or 0

    @property
    def num_workers(self) -> int:
        """The cluster's worker count in force (``--num-workers`` until a resize)."""
        return self.cluster.membership.num_workers

    @property
    def members(self) -> list[Member]:
        return self.cluster.membership.members

    def now(self) -> float:
        """The shard's monotonic clock, in seconds."""
        return self._now()

    # ----------------------------------------------------------------- validation
    def check_rank(self, rank: int) -> None:
        """Raise InvalidRequestError when ``rank`` is out of range."""
        self.membership.get(rank)

    def check_live(self, rank: int, incarnation: int) -> None:
        """Raise unless ``rank`` is a live member under ``incarnation`` (InvalidRequestError,
        SupersededError, NotJoinedError); a data connection's frames come from members only."""
        with self._cond:
            self.membership.check_live(self.membership.get(rank, incarnation), incarnation)

    check_plan = delegated("data", DataPath.check_plan)
    check_wire_dtype = staticmethod(DataPath.check_wire_dtype)

    def check_request(self, digest: str, rank: int, incarnation: int, session: int, what: str) -> Plan:
        """A push-type request's header (``what``): :meth:`DataPath.check_plan` of ``digest``, then
        ``rank``'s session (:meth:`ShardMembers.check_session`). Returns the plan."""
        with self._cond:
            plan = self.data.check_plan(digest)
            self.cluster.check_session(rank, incarnation, session, what)
            return plan

    # ----------------------------------------------------------------- membership (ShardMembers)
    join = _locked("cluster", ShardMembers.join)
    check_session = _locked("cluster", ShardMembers.check_session)
    check_member = _locked("cluster", ShardMembers.check_member)
    heartbeat = _locked("cluster", ShardMembers.heartbeat)
    leave = _locked("cluster", ShardMembers.leave)
    evict = _locked("cluster", ShardMembers.evict)
    adopt = _locked("cluster", ShardMembers.adopt)
    resize = _locked("cluster", ShardMembers.resize)
    expire_leases = _locked("cluster", ShardMembers.expire_leases)
    report_missing = _locked("cluster", ShardMembers.report_missing)

    session_is = _locked("cluster", ShardMembers.session_is)
    is_live = _locked("cluster", ShardMembers.is_live)
    join_relaying = _locked("relay", MembershipRelay.join_relaying)
    heartbeat_relaying = _locked("relay", MembershipRelay.heartbeat_relaying)
    leave_relaying = _locked("relay", MembershipRelay.leave_relaying)
    resize_request = _locked("relay", MembershipRelay.resize_request)
    told = _locked("relay", MembershipRelay.told)

    # ----------------------------------------------------------------- init
    init_plan = delegated("data", DataPath.init_plan)

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
        """First writer wins: set the plan, initial values and optimizer (``plan``: :meth:`init_plan`
        of the other arguments, when the caller has it) at ``version`` (diloco: a shard that restarted
        empty takes theta_global at the ranks' outer round). Returns (applied, version, plan digest):
        not applied when already initialized with the same plan.

        Raises:
            InvalidRequestError: as :meth:`DataPath.init_plan`, a bad partition or optimizer spec.
            PlanMismatchError: already initialized with another plan.
        """
        plan = plan or self.init_plan(specs, num_shards, partition_bytes, digest)
        with self._cond:
            if self.plan is not None:
                return self.data.initialized(digest)
        values = match_partitions(plan, self.shard_index, partitions, "value")
        store = ParameterStore(plan, self.shard_index, values, optimizer)
        with self._cond:
            if self.plan is not None:  # lost a race with another Init
                return self.data.initialized(digest)
            self._install(plan, store)
            if version:
                self.rounds = SyncRounds(round=version)
                self.set_version(version)  # and the config changes due there
            what = (self.shard_index, len(store.partitions), store.num_bytes, plan.digest[:12], optimizer.name, version)
            log.info("shard %d: initialized with %d partitions (%d B), plan %s, optimizer %s, at version %d", *what)
            self._cond.notify_all()
            return True, self.version, plan.digest

    def _install(self, plan: Plan, store: ParameterStore) -> None:
        self.plan, self.store = plan, store
        self.stream = None
        self.clips.forget()
        self.data.store_epoch += 1

    # ----------------------------------------------------------------- the data path (DataPath)
    push = delegated("data_calls", DataCalls.push)  # takes the lock in phases
    wait_durable = delegated("data_calls", DataCalls.wait_durable)  # takes the lock with durable_acks
    pull = delegated("data_calls", DataCalls.pull)
    push_pull = delegated("data_calls", DataCalls.push_pull)
    exchange = delegated("data_calls", DataCalls.exchange)  # takes the lock in phases
    values_key = _locked("data", DataPath.values_key)
    request_clip = _locked("clips", RoundClips.request)
    wait_clip_norm = _locked("clips", RoundClips.wait_norm)
    apply_clip = _locked("clips", RoundClips.apply)

    # ----------------------------------------------------------------- streamed rounds (RoundStreams)
    join_stream = _locked("streams", RoundStreams.join)
    leave_stream = _locked("streams", RoundStreams.leave)
    stream_slots = _locked("streams", RoundStreams.slots)
    stream_held = delegated("streams", RoundStreams.held)  # the caller holds the lock
    end_stream = delegated("streams", RoundStreams.end)  # the caller holds the lock

    # ----------------------------------------------------------------- the policy's shard (ShardCore)
    record = delegated("data", DataPath.record)
    refusal = delegated("data", DataPath.refusal)
    refuse_round = delegated("data", DataPath.refuse_round)

    def set_version(self, version: int) -> None:
        """Advance the version; at every ``checkpoint_every``-th version hand a snapshot to
        ``on_snapshot`` (taken under the lock, so every sync shard snapshots the same rounds)."""
        self.version = version
        self.membership.settle(version)
        self.config.apply_due()
        if self.checkpoint_every and self.on_snapshot and version % self.checkpoint_every == 0:
            self.on_snapshot(version, self.export_state())

    apply_due = delegated("config", ConfigChanges.apply_due)

    def notify(self) -> None:
        """Wake every wait on the shard's lock (caller holds it)."""
        self._cond.notify_all()

    def wake(self) -> None:
        """Take the lock and wake every wait on it (a push partition landed on a data connection)."""
        with self._cond:
            self._cond.notify_all()

    def advance(self) -> None:
        """Let the policy close a complete round or period, switch a pending mode at a round
        boundary (the new policy takes over), and wake waiters. Caller holds the lock."""
        self.policy.advance(self)
        if self.pending_mode and not self.rounds.pending and self.clips.held is None:
            log.info(
                "shard %d: mode %s -> %s at version %d", self.shard_index, self.mode, self.pending_mode, self.version
            )
            self.settings = self.settings.updated(mode=self.pending_mode)
            self.config.pending_mode = ""
            self.refusals.clear()  # told only while their rounds are the open ones
            self.rounds = SyncRounds(round=self.version)
            self.policy.on_switch(self)
        self._cond.notify_all()

    def wait_for_ranks(
        self,
        ready: Callable[[], bool],
        deadline: float | None,
        describe: Callable[[], str],
        awaited: Callable[[], Awaited | None] | None = None,
    ) -> None:
        """Wait for a round or read that needs every expected rank; caller holds the lock.
        ``awaited``: whom it waits for (:meth:`Waits.for_ranks`).

        Raises:
            AwaitingRanksError: the call's deadline came while the awaited ranks still count.
            RanksMissingError: ranks never joined within the join timeout (see
                :class:`~ps_server.membership.ranks.JoinDeadline`), and it is still not ready then.
            ShuttingDownError: closing. WaitTimeoutError: ``deadline`` passed.
        """
        quorum = lambda: self.policy.quorum(self.settings)  # noqa: E731
        self.waits.for_ranks(ready, deadline, describe, self.membership, self.report_missing, quorum, awaited)

    # ----------------------------------------------------------------- checkpoints (StateCodec)
    def checkpointed(self, version: int) -> None:
        """The newest checkpoint on disk is at ``version``: wake the answers waiting for it (``durable_acks``)."""
        with self._cond:
            self.data.last_checkpoint_version = version
            self._cond.notify_all()

    def export_state(self) -> dict[str, Any]:
        """Everything a restarted shard needs, as plain data (a streamed round's speculative
        partitions are put back first); see :meth:`StateCodec.export`.

        Raises:
            NotInitializedError: nothing to save yet.
        """
        with self._cond:
            self.streams.end("a checkpoint needed the parameters mid-round")
            return self.codec.export(self)

    def restore(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`export_state` output: parameters, optimizer state, version and
        members (live ranks get a fresh lease to come back in).

        Raises:
            CheckpointError: the checkpoint belongs to another cluster shape or plan.
        """
        plan, store = self.codec.load(state)
        with self._cond:
            self._install(plan, store)
            self.version = int(state["version"])
            self.rounds = SyncRounds(round=self.version)
            self.codec.restore(state, self.membership, self.epochs, self.tables)
            self.cluster.restored(state)
            self.restored_from_version = self.data.last_checkpoint_version = self.version
            log.info("shard %d: resumed from its checkpoint at version %d", self.shard_index, self.version)
            self._cond.notify_all()

    # ----------------------------------------------------------------- admin (ConfigChanges)
    update_config = _locked("config", ConfigChanges.update_config)
    status = _locked("config", ConfigChanges.status)
    change_config = _locked("config", ConfigChanges.change_config)

    learning_rate = delegated("config", ConfigChanges.learning_rate)  # needs no lock
    table_metrics = _locked("table_calls", TableCalls.metrics)
    expire_table_rows = _locked("tables", TableStore.expire)  # a bounded sweep per timer tick

    def close(self) -> None:
        """Wake every waiter with ShuttingDownError."""
        with self._cond:
            self.waits.close()

    # ----------------------------------------------------------------- embedding tables (TableCalls)
    init_tables = _locked("table_calls", TableCalls.init_tables)
    pull_rows = delegated("table_calls", TableCalls.pull_rows)  # takes the lock in phases
    push_rows = delegated("table_calls", TableCalls.push_rows)  # takes the lock in phases

    # ----------------------------------------------------------------- optimizer state (OptimizerStates)
    optimizer_state_layout = _locked("optimizer_states", OptimizerStates.layout)
    read_optimizer_state = _locked("optimizer_states", OptimizerStates.read)
    stage_optimizer_state = _locked("optimizer_states", OptimizerStates.stage)
    commit_optimizer_state = _locked("optimizer_states", OptimizerStates.commit)
