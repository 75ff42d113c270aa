"""What a shard's collaborators read of the shard they serve: one Protocol per collaborator.

The collaborators (:class:`~ps_server.shard.members.ShardMembers`,
:class:`~ps_server.shard.admin.ConfigChanges`, :class:`~ps_server.shard.data.DataPath`,
:class:`~ps_server.shard.state.StateCodec`) are given the :class:`~ps_server.shard.shard.Shard`
facade typed as one of these, so none imports the facade, the policies or the streamed rounds: every
attribute and method here is read or called under the shard's lock, which the facade holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ps_common.errors import UpdateRefusedError
from ps_common.modes import ModeSettings
from ps_common.plan import Plan
from ps_server.core.limits import Limits
from ps_server.membership.ranks import Member, Membership, PushResult, PushStamp
from ps_server.policy.rounds import SyncRounds
from ps_server.policy.types import Awaited
from ps_server.shard.counters import ShardCounters
from ps_server.shard.round_stream import RoundStreams
from ps_server.shard.store import ParameterStore
from ps_server.shard.waits import Waits
from ps_server.tables.store import TableStore


class Policy(Protocol):
    """The parts of a consistency policy (:class:`~ps_server.policy.base.ConsistencyPolicy`) the
    collaborators ask; ``shard`` is the facade."""

    holds_pushes: bool
    resizable: bool

    def join_clock(self, shard: Any, member: Member, restarted: bool) -> int: ...
    def accept(self, shard: Any, member: Member, stamp: PushStamp, *args: Any) -> PushResult: ...
    def check_read(self, shard: Any, member: Member, joined: bool, min_version: int) -> None: ...
    def can_read(self, shard: Any, member: Member, joined: bool, min_version: int) -> bool: ...
    def blocked(self, shard: Any, member: Member, min_version: int, timeout: float | None) -> str: ...
    def after_read(self, shard: Any, member: Member, joined: bool, min_version: int) -> None: ...
    def check_exchange(self) -> None: ...
    def exchange(self, shard: Any, member: Member, stamp: PushStamp, x: Any, deadline: float | None) -> Any: ...


class ShardState(Protocol):
    """The shard's state every collaborator may read: who it is, its settings, plan, store, version
    and open round, its counters."""

    shard_index: int
    settings: ModeSettings
    version: int
    plan: Plan | None
    store: ParameterStore | None
    rounds: SyncRounds
    counters: ShardCounters

    @property
    def mode(self) -> str: ...

    def advance(self) -> None:
        """Let the policy close what is complete, switch a pending mode, wake the waiters."""


class MembersHost(ShardState, Protocol):
    """What :class:`~ps_server.shard.members.ShardMembers` reads and changes."""

    refusals: dict[int, UpdateRefusedError]
    refused_at: int | None
    round_opened: float | None
    round_reported: bool
    lost_round: str

    @property
    def policy(self) -> Policy: ...

    def now(self) -> float: ...
    def learning_rate(self) -> float: ...
    def apply_due(self) -> None: ...
    def notify(self) -> None: ...


class AdminHost(ShardState, Protocol):
    """What :class:`~ps_server.shard.admin.ConfigChanges` reads and changes (a status shows it all)."""

    num_shards: int
    lease_timeout: float
    round_opened: float | None
    max_clock_gap: int
    restored_from_version: int | None
    tables: TableStore

    durable_acks: bool
    last_checkpoint_version: int | None

    def now(self) -> float: ...
    def learning_rate(self) -> float: ...


class DataHost(ShardState, Protocol):
    """What :class:`~ps_server.shard.data.DataPath` reads and changes, and the hooks it calls."""

    num_shards: int
    limits: Limits
    refused_at: int | None
    refusals: dict[int, UpdateRefusedError]
    lost_round: str
    waits: Waits
    streams: RoundStreams
    last_checkpoint_version: int | None

    @property
    def membership(self) -> Membership: ...

    @property
    def policy(self) -> Policy: ...

    def notify(self) -> None: ...
    def wait_for_ranks(
        self,
        ready: Callable[[], bool],
        deadline: float | None,
        describe: Callable[[], str],
        awaited: Callable[[], Awaited | None] | None = None,
    ) -> None: ...
