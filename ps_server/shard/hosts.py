"""What a shard's collaborators read of the shard they serve.

The collaborators (:class:`~ps_server.shard.members.ShardMembers`,
:class:`~ps_server.shard.admin.ConfigChanges`, :class:`~ps_server.shard.data.DataPath`) are given the
:class:`~ps_server.shard.shard.Shard` facade typed as one of these, so none imports the facade: every
attribute and method here is read or called under the shard's lock. Each is the policy's view of the
shard (:class:`~ps_server.policy.base.ShardCore`: a collaborator hands the shard to its policy) and
what the collaborator reads besides.
"""

from __future__ import annotations

from typing import Protocol

from ps_server.core.limits import Limits
from ps_server.policy.base import ShardCore
from ps_server.shard.round_stream import RoundStreams
from ps_server.shard.waits import Waits
from ps_server.tables.store import TableStore


class MembersHost(ShardCore, Protocol):
    """What :class:`~ps_server.shard.members.ShardMembers` reads and changes."""

    refused_at: int | None

    def learning_rate(self) -> float: ...
    def apply_due(self) -> None: ...


class AdminHost(ShardCore, Protocol):
    """What :class:`~ps_server.shard.admin.ConfigChanges` reads and changes (a status shows it all)."""

    num_shards: int
    lease_timeout: float
    restored_from_version: int | None
    tables: TableStore
    durable_acks: bool
    last_checkpoint_version: int | None

    def learning_rate(self) -> float: ...


class DataHost(ShardCore, Protocol):
    """What :class:`~ps_server.shard.data.DataPath` reads and changes, and the streams it ends."""

    num_shards: int
    limits: Limits
    refused_at: int | None
    waits: Waits
    streams: RoundStreams
    last_checkpoint_version: int | None
