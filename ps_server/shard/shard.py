"""One shard's state behind one condition: :class:`Shard` keeps the round state and its collaborators.

Each collaborator owns one part of the state: :class:`~ps_server.shard.members.ShardMembers` (ranks,
membership epochs), :class:`~ps_server.shard.admin.ConfigChanges` (configuration changes, status),
:class:`~ps_server.shard.data.DataPath` (push, pull, exchange, their bookkeeping),
:class:`~ps_server.shard.state.StateCodec` (checkpoint state), the
:class:`~ps_server.shard.store.ParameterStore` and the :class:`~ps_server.tables.store.TableStore`;
their methods assume the shard's lock is held. The classes a servicer calls take the lock themselves:
:class:`~ps_server.shard.data_calls.DataCalls` (Init, Push, Pull, PushPull, Exchange) and
:class:`~ps_server.tables.calls.TableCalls` (InitTables, PullRows, PushRows) in phases, leaving out of
it the work that needs no shared state (matching partitions, decoding ids);
:class:`~ps_server.shard.relay.MembershipRelay` (membership requests and the records they relay),
:class:`~ps_server.shard.round_stream.RoundStreams` (streamed sync rounds),
:class:`~ps_server.shard.clipping.RoundClips` (clipped rounds) and
:class:`~ps_server.shard.optimizer_state.OptimizerStates` (the optimizer state in torch's layout).
The shard's own methods take the lock for the other calls. Its consistency model
(:data:`ps_server.policy.POLICIES`, by ``settings.mode``) decides what a push does, when a round
closes and when a read is served; the shard is the :class:`~ps_server.policy.base.ShardCore` it is
given. Reads hand a :class:`Snapshot` to the caller's ``encode`` under the lock (``service/frame_cache``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ps_common.errors import UpdateRefusedError
from ps_common.modes import MODES, ModeSettings
from ps_common.plan import Plan
from ps_proto.v1 import ps_pb2
from ps_server.core.limits import Limits
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
from ps_server.shard.members import ShardMembers
from ps_server.shard.optimizer_state import OptimizerStates
from ps_server.shard.relay import MembershipRelay
from ps_server.shard.round_stream import RoundStream, RoundStreams
from ps_server.shard.state import StateCodec
from ps_server.shard.store import ParameterStore
from ps_server.shard.views import JoinInfo, Snapshot, StatusView
from ps_server.shard.waits import Waits
from ps_server.tables.calls import TableCalls
from ps_server.tables.store import TableStore
from ps_server.tables.table import DEFAULT_MAX_TABLE_ROWS

log = logging.getLogger(__name__)

__all__ = ["MODES", "Shard", "WorkerState", "PushResult", "PushStamp", "StatusView", "MemberView", "Snapshot"]

SnapshotHook = Callable[[int, dict[str, Any]], None]
"""Called with (version, :meth:`Shard.export_state` output) under the shard's lock."""


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
        self.durable_acks = False  # answer pushes once their version is durable (--durable-acks)
        self.last_checkpoint_version: int | None = None  # the newest on disk
        self.tables = TableStore(shard_index, num_shards, DEFAULT_MAX_TABLE_ROWS)  # embedding tables
        # the collaborators: each owns its part of the state; those a servicer calls through the methods
        # below take the lock themselves, the others assume it held (this shard's methods take it)
        self.cluster = ShardMembers(
            self, shard_index, settings, lease_timeout, now, join_timeout, record_key, cluster_id
        )
        self.membership: Membership = self.cluster.membership
        """The shard's ranks (owned by :class:`ShardMembers`; the same object for the shard's life)."""
        self.epochs: Epochs = self.cluster.epochs
        """Shard 0's membership records (owned by :class:`ShardMembers`, as :attr:`membership`)."""
        self.relay = MembershipRelay(self, self.cluster, self._cond)
        self.config = ConfigChanges(self, self.cluster)
        self.data = DataPath(self)
        self.codec = StateCodec(shard_index, num_shards)
        self.streams = RoundStreams(self, self._cond)
        self.table_calls = TableCalls(self, self._cond)
        self.data_calls = DataCalls(self, self._cond)
        self.clips = RoundClips(self, self._cond)
        self.optimizer_states = OptimizerStates(self, self._cond)
        # the calls a servicer makes by these names that need no lock or take it themselves, and the
        # policy's bookkeeping hooks (its caller holds the lock): the collaborators' own methods
        data, calls, tables, relay, streams = self.data, self.data_calls, self.table_calls, self.relay, self.streams
        self.check_plan, self.init_plan, self.init = data.check_plan, data.init_plan, calls.init
        self.record, self.refusal, self.refuse_round = data.record, data.refusal, data.refuse_round
        self.push, self.pull, self.push_pull, self.exchange = calls.push, calls.pull, calls.push_pull, calls.exchange
        self.init_tables, self.pull_rows, self.push_rows = tables.init_tables, tables.pull_rows, tables.push_rows
        self.table_metrics = tables.metrics
        self.join_relaying, self.heartbeat_relaying = relay.join_relaying, relay.heartbeat_relaying
        self.leave_relaying, self.resize_request, self.told = relay.leave_relaying, relay.resize_request, relay.told
        self.join_stream, self.leave_stream, self.stream_slots = streams.join, streams.leave, streams.slots
        clips, states = self.clips, self.optimizer_states
        self.request_clip, self.wait_clip_norm, self.apply_clip = clips.request, clips.wait_norm, clips.apply
        self.optimizer_state_layout, self.read_optimizer_state = states.layout, states.read
        self.stage_optimizer_state, self.commit_optimizer_state = states.stage, states.commit

    # ----------------------------------------------------------------- views of the collaborators' state
    @property
    def mode(self) -> str:
        return self.settings.mode

    @property
    def policy(self) -> ConsistencyPolicy:
        """The consistency model in force (a mode switch swaps it at a round boundary)."""
        return POLICIES[self.settings.mode]

    @property
    def pending_mode(self) -> str:
        """The mode switched to at the next round boundary (:class:`ConfigChanges`)."""
        return self.config.pending_mode

    @property
    def redo_from(self) -> int | None:
        """The newest checkpoint, when a kill -9 can lose answered rounds (periodic checkpoints without
        durable acks): workers keep their pushes from there on (``ps_worker/redo.py``); else None."""
        return None if not self.checkpoint_every or self.durable_acks else self.last_checkpoint_version or 0

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
        """Raise unless ``rank`` is a live member under ``incarnation`` (InvalidRequestError,
        SupersededError, NotJoinedError); a data connection's frames come from members only."""
        with self._cond:
            self.membership.check_live(self.membership.get(rank, incarnation), incarnation)

    def check_request(self, digest: str, rank: int, incarnation: int, session: int, what: str) -> Plan:
        """A push-type request's header (``what``): :meth:`DataPath.check_plan` of ``digest``, then
        ``rank``'s session (:meth:`ShardMembers.check_session`). Returns the plan.

        Without the lock when the session is the rank's current one (:meth:`ShardMembers.session_is`
        reads the member list and one member's fields, each read atomic): it was current at an
        instant of this call, which is what the check under the lock finds when it runs then (the
        push's own hold checks liveness and replay again). Anything else is checked under the lock
        and refused there with its reason, so a step takes the lock once, for its push and its read
        (:meth:`DataCalls.push_pull`)."""
        plan = self.data.check_plan(digest)  # the plan is fixed once set
        if not self.cluster.session_is(rank, incarnation, session):
            with self._cond:
                self.cluster.check_session(rank, incarnation, session, what)
        return plan

    # ----------------------------------------------------------------- membership (ShardMembers)
    def join(self, rank: int, num_workers: int, incarnation: int, epoch: int = 0) -> JoinInfo:
        with self._cond:
            return self.cluster.join(rank, num_workers, incarnation, epoch)

    def check_session(self, rank: int, incarnation: int, session: int, what: str) -> None:
        with self._cond:
            self.cluster.check_session(rank, incarnation, session, what)

    def session_is(self, rank: int, incarnation: int, session: int) -> bool:
        with self._cond:
            return self.cluster.session_is(rank, incarnation, session)

    def heartbeat(self, rank: int, incarnation: int) -> tuple[int, WorkerState]:
        with self._cond:
            return self.cluster.heartbeat(rank, incarnation)

    def leave(self, rank: int, incarnation: int) -> int:
        with self._cond:
            return self.cluster.leave(rank, incarnation)

    def evict(self, rank: int) -> tuple[WorkerState, int]:
        with self._cond:
            return self.cluster.evict(rank)

    def adopt(self, record: ps_pb2.MembershipEpoch) -> bool:
        with self._cond:
            return self.cluster.adopt(record)

    def resize(self, num_workers: int, at_version: int | None = None) -> tuple[int, int]:
        with self._cond:
            return self.cluster.resize(num_workers, at_version)

    def expire_leases(self) -> list[int]:
        with self._cond:
            return self.cluster.expire_leases()

    def report_missing(self) -> list[int]:
        with self._cond:
            return self.cluster.report_missing()

    # ----------------------------------------------------------------- init and restore
    def install(self, plan: Plan, store: ParameterStore) -> None:
        """Take ``plan`` and ``store`` (an Init, a restore): a new store epoch. Caller holds the lock."""
        self.plan, self.store = plan, store
        self.stream = None
        self.clips.forget()
        self.data.store_epoch += 1

    # ----------------------------------------------------------------- the data path
    def values_key(self) -> tuple[int, int]:
        """(version, store epoch) now: the parameters' values are the same while both are."""
        with self._cond:
            return self.version, self.data.store_epoch

    # ----------------------------------------------------------------- the policy's shard (ShardCore)
    def set_version(self, version: int) -> None:
        """Advance the version; at every ``checkpoint_every``-th version hand a snapshot to
        ``on_snapshot`` (taken under the lock, so every sync shard snapshots the same rounds)."""
        self.version = version
        self.membership.settle(version)
        self.config.apply_due()
        if self.checkpoint_every and self.on_snapshot and version % self.checkpoint_every == 0:
            self.on_snapshot(version, self.export_state())

    def apply_due(self) -> None:
        """Apply the configuration changes the version has reached (caller holds the lock)."""
        self.config.apply_due()

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
        if ready():  # nothing to wait for (most reads): no deadline to work out
            return
        quorum = lambda: self.policy.quorum(self.settings)  # noqa: E731
        self.waits.for_ranks(ready, deadline, describe, self.membership, self.cluster.report_missing, quorum, awaited)

    # ----------------------------------------------------------------- checkpoints (StateCodec)
    def checkpointed(self, version: int) -> None:
        """The newest checkpoint on disk is at ``version``: wake the answers waiting for it (``durable_acks``)."""
        with self._cond:
            self.last_checkpoint_version = version
            self._cond.notify_all()

    def export_state(self) -> dict[str, Any]:
        """Everything a restarted shard needs, as plain data (a streamed round's speculative
        partitions are put back first); see :meth:`StateCodec.export`.

        Raises:
            NotInitializedError: nothing to save yet.
        """
        with self._cond:
            self.streams.end("a checkpoint needed the parameters mid-round")
            return self.codec.export(
                self.plan, self.store, self.version, self.mode, self.rounds, self.cluster, self.tables
            )

    def restore(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`export_state` output: parameters, optimizer state, version and
        members (live ranks get a fresh lease to come back in).

        Raises:
            CheckpointError: the checkpoint belongs to another cluster shape or plan.
        """
        plan, store = self.codec.load(state)
        with self._cond:
            self.install(plan, store)
            self.version = int(state["version"])
            self.rounds = SyncRounds(round=self.version)
            self.codec.restore(state, self.membership, self.epochs, self.tables)
            self.cluster.restored(state)
            self.restored_from_version = self.last_checkpoint_version = self.version
            log.info("shard %d: resumed from its checkpoint at version %d", self.shard_index, self.version)
            self._cond.notify_all()

    # ----------------------------------------------------------------- admin (ConfigChanges)
    def update_config(self, mode: str = "", learning_rate: float | None = None, **changes: Any) -> ModeSettings:
        with self._cond:
            return self.config.update_config(mode, learning_rate, **changes)

    def change_config(
        self, mode: str = "", learning_rate: float | None = None, **changes: Any
    ) -> tuple[ModeSettings, StatusView]:
        with self._cond:
            return self.config.change_config(mode, learning_rate, **changes)

    def status(self) -> StatusView:
        with self._cond:
            return self.config.status()

    def learning_rate(self) -> float:
        """The optimizer's learning rate in force (0 before Init); needs no lock."""
        store = self.store
        return float(store.optimizer.param_groups[0]["lr"]) if store else 0.0

    def expire_table_rows(self) -> int:
        """Evict expired rows, a bounded sweep per timer tick."""
        with self._cond:
            return self.tables.expire()

    def close(self) -> None:
        """Wake every waiter with ShuttingDownError."""
        with self._cond:
            self.waits.close()
