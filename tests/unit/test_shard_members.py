"""ShardMembers on its own: a fake host stands for the shard facade, and no lock exists at all."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from ps_common.errors import NotJoinedError, PreconditionError, WrongRankError
from ps_common.modes import ModeSettings
from ps_server.membership.ranks import Member
from ps_server.policy.sync import SyncRounds
from ps_server.shard.counters import ShardCounters
from ps_server.shard.members import ShardMembers


class KeepClock:
    """An async-like policy: the rank resumes where it was; no rounds hold pushes; resizable."""

    holds_pushes = False
    resizable = True

    def join_clock(self, shard: Any, member: Member, restarted: bool) -> int:
        return member.clock


@dataclass
class Host:
    """What ShardMembers reads of a shard (MembersHost), with the hooks it calls counted."""

    shard_index: int = 0
    settings: ModeSettings = field(default_factory=lambda: ModeSettings("async", 2))
    version: int = 0
    plan: Any = None
    store: Any = None
    refusals: dict = field(default_factory=dict)
    refused_at: int | None = None
    round_opened: float | None = None
    round_reported: bool = False
    rounds: SyncRounds = field(default_factory=SyncRounds)
    counters: ShardCounters = field(default_factory=ShardCounters)
    calls: list[str] = field(default_factory=list)
    t: float = 100.0

    @property
    def mode(self) -> str:
        return self.settings.mode

    @property
    def policy(self) -> KeepClock:
        return KeepClock()

    def now(self) -> float:
        return self.t

    def learning_rate(self) -> float:
        return 0.0

    def advance(self) -> None:
        self.calls.append("advance")

    def apply_due(self) -> None:
        self.calls.append("apply_due")

    def notify(self) -> None:
        self.calls.append("notify")


def members_of(host: Host) -> ShardMembers:
    return ShardMembers(host, host.shard_index, host.settings, 5.0, host.now, 0.0, "", "c1")


def test_the_first_join_on_shard_0_forms_the_cluster_and_draws_a_session() -> None:
    host = Host()
    members = members_of(host)
    info = members.join(0, 2, incarnation=7)
    assert info.session and not info.initialized and info.version == 0
    assert members.epochs.epoch > 0 and "formed" in members.epochs.record.reason
    assert members.is_live(0, 7) and not members.is_live(0, 8) and not members.is_live(5, 7)
    assert members.session_is(0, 7, info.session) and not members.session_is(1, 7, info.session)
    assert "notify" in host.calls


def test_a_session_of_another_rank_is_refused_and_no_session_asks_for_a_join() -> None:
    members = members_of(Host())
    first = members.join(0, 2, 1).session
    members.join(1, 2, 1)
    with pytest.raises(WrongRankError, match="carries the session of rank 0"):
        members.check_session(1, 1, first, "Push")
    with pytest.raises(NotJoinedError, match="carries no session"):
        members.check_session(1, 1, 0, "Push")
    members.check_session(0, 1, first, "Push")


def test_only_shard_0_resizes_and_evicts() -> None:
    members = members_of(Host(shard_index=1))
    with pytest.raises(PreconditionError, match="send Resize to shard 0"):
        members.resize(3)
    with pytest.raises(PreconditionError, match="send EvictWorker to shard 0"):
        members.evict(0)
