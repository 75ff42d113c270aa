"""Consistency policies (docs/architecture.md#5-consistency): pure code, no grpc, no sockets, no sleeping.

:data:`POLICIES` maps each ``--mode`` to its :class:`~ps_server.policy.base.ConsistencyPolicy`.
"""

from __future__ import annotations

from ps_server.policy.asynchronous import AsyncPolicy
from ps_server.policy.base import ConsistencyPolicy, ShardCore
from ps_server.policy.diloco import DilocoPolicy
from ps_server.policy.easgd import EasgdPolicy
from ps_server.policy.ssp import SspPolicy
from ps_server.policy.sync import SyncPolicy

POLICIES: dict[str, ConsistencyPolicy] = {
    policy.mode: policy for policy in (SyncPolicy(), AsyncPolicy(), SspPolicy(), EasgdPolicy(), DilocoPolicy())
}
"""Mode name -> its policy (stateless: one instance serves every shard)."""

__all__ = [
    "POLICIES",
    "AsyncPolicy",
    "ConsistencyPolicy",
    "DilocoPolicy",
    "EasgdPolicy",
    "ShardCore",
    "SspPolicy",
    "SyncPolicy",
]
