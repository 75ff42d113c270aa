"""What a :class:`~ps_server.shard.shard.Shard` hands out: a Join's answer, a status snapshot for
operators, and the consistent snapshot of its parameters that a read encodes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ps_common.modes import ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_common.plan import Plan
from ps_proto.v1 import ps_pb2
from ps_server.membership.ranks import MemberView


@dataclass(frozen=True)
class JoinInfo:
    """A Join's answer: whether the shard is initialized, its version and plan digest, the clock
    the rank resumes at, the optimizer spec (None before Init) and the join's session (random,
    nonzero, new at every Join: every push-type request of the rank carries it)."""

    initialized: bool
    version: int
    plan_digest: str
    clock: int
    optimizer: OptimizerSpec | None = None
    session: int = 0
    membership: ps_pb2.MembershipEpoch | None = None
    """The membership record the shard follows (a Join request's answer)."""
    settings: ModeSettings | None = None
    """The shard's settings (a Join request's answer)."""
    learning_rate: float = 0.0


@dataclass(frozen=True)
class StatusView:
    """A consistent snapshot of a shard for Admin/GetStatus (counters: ``Shard.counters``)."""

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
    membership: ps_pb2.MembershipEpoch = field(default_factory=ps_pb2.MembershipEpoch)
    """The membership record the shard follows (a copy)."""
    applied_changes: tuple[ps_pb2.ConfigChange, ...] = ()
    membership_authority: bool = False
    durable_acks: bool = False
    tables: tuple[ps_pb2.TableStatus, ...] = ()
    """Embedding tables this shard holds rows of (issue 19)."""
    tables_version: int = 0

    @property
    def mode(self) -> str:
        return self.settings.mode

    @property
    def num_workers(self) -> int:
        return self.settings.num_workers


@dataclass(frozen=True)
class Snapshot:
    """Tensors of a shard at one version, handed to a read's ``encode`` under the shard's lock
    (copy or encode them there: they change once the lock is released).

    Attributes:
        version: the shard's version (a Pull's) or the version an exchange made.
        epoch: counts the shard's Init and restores: (version, epoch) names one set of values.
        plan: the shard's plan. shard_index: this shard.
        partitions: (key, offset, length) of each partition owned, in plan order.
        tensors: one 1-D tensor per partition, in the plan's dtypes (the parameters, or an
            exchange's d).
    """

    version: int
    epoch: int
    plan: Plan
    shard_index: int
    partitions: Sequence[tuple[str, int, int]]
    tensors: Sequence[torch.Tensor]


def clone_tensors(snapshot: Snapshot) -> list[torch.Tensor]:
    """The default ``encode`` of a read: copies of the snapshot's tensors."""
    return [t.detach().clone() for t in snapshot.tensors]
