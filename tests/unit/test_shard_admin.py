"""ConfigChanges on its own: configuration changes scheduled, applied when due, and the status,
over a fake host standing for the shard facade (no lock exists)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from ps_common.errors import InvalidRequestError, NotInitializedError, PreconditionError
from ps_common.modes import ModeSettings
from ps_server.shard.admin import ConfigChanges
from ps_server.shard.members import ShardMembers
from ps_server.tables.store import TableStore
from tests.unit.test_shard_members import Host


@dataclass
class AdminHost(Host):
    """A MembersHost that is an AdminHost too."""

    num_shards: int = 1
    lease_timeout: float = 5.0
    max_clock_gap: int = 0
    restored_from_version: int | None = None
    durable_acks: bool = False
    last_checkpoint_version: int | None = None
    tables: TableStore = field(default_factory=lambda: TableStore(0, 1, 1000))
    settings: ModeSettings = field(default_factory=lambda: ModeSettings("sync", 2))


def config_of(host: AdminHost) -> tuple[ConfigChanges, ShardMembers]:
    members = ShardMembers(host, host.shard_index, host.settings, 5.0, host.now, 0.0, "", "c1")
    return ConfigChanges(host, members), members


def test_a_change_is_applied_when_the_version_reaches_it() -> None:
    host = AdminHost()
    config, members = config_of(host)
    members.join(0, 2, 1)  # a live rank: the change holds from the next round
    settings, view = config.change_config(round_timeout=30.0)
    assert settings.round_timeout == 30.0 and host.settings.round_timeout == 0.0
    assert view.membership.config_changes[-1].version == 1
    host.version = 1
    config.apply_due()
    assert host.settings.round_timeout == 30.0


def test_a_mode_switch_waits_for_the_round_boundary_as_pending_mode() -> None:
    host = AdminHost()
    config, _ = config_of(host)
    config.update_config(mode="async")  # no rank live: due at this version
    assert config.pending_mode == "async" and host.settings.mode == "sync"
    assert config.status().pending_mode == "async"


def test_refused_changes_schedule_nothing() -> None:
    host = AdminHost()
    config, members = config_of(host)
    with pytest.raises(NotInitializedError, match="after Init"):
        config.update_config(learning_rate=0.1)
    with pytest.raises(InvalidRequestError, match="finite number"):
        config.update_config(learning_rate=float("nan"))
    assert members.epochs.pending() == []
    follower, _ = config_of(AdminHost(shard_index=1))
    with pytest.raises(PreconditionError, match="send UpdateConfig to shard 0"):
        follower.update_config(round_timeout=1.0)


def test_the_status_shows_the_host_and_the_members() -> None:
    host = AdminHost()
    config, members = config_of(host)
    members.join(1, 2, 1)
    view = config.status()
    assert view.shard_index == 0 and view.mode == "sync" and view.membership_authority
    assert [w.state for w in view.workers][1].value == "live" and not view.initialized


def test_a_diloco_change_is_stamped_with_the_inner_step_its_round_starts_at() -> None:
    """H 10 -> 4 at version 5, then F 2 at version 8: rounds 0-4 take 10 inner steps, 5-7 take 4."""
    host = AdminHost(settings=ModeSettings("diloco", 2, communication_period=10))
    config, members = config_of(host)
    config.update_config(communication_period=4, at_version=5)
    config.update_config(fragments=2, at_version=8)
    stamped = members.epochs.record.config_changes
    assert [(c.version, c.inner_step) for c in stamped] == [(5, 50), (8, 62)]
    sync = AdminHost()
    config, members = config_of(sync)
    config.update_config(round_timeout=3.0, at_version=2)
    assert not members.epochs.record.config_changes[-1].HasField("inner_step")  # counted only in diloco
