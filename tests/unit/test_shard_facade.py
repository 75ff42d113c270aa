"""The Shard facade: the one object that takes a shard's lock, over its collaborators."""

from __future__ import annotations

import pytest

from ps_common.errors import InvalidRequestError
from ps_common.modes import ModeSettings
from ps_common.plan import ParameterSpec, make_plan
from ps_server.shard.data import DataPath
from ps_server.shard.shard import Shard


def test_calls_through_the_facade_run_their_collaborator_under_the_lock() -> None:
    owned: list[bool] = []
    shards: list[Shard] = []

    def now() -> float:
        if shards:
            owned.append(shards[0]._cond._is_owned())  # type: ignore[attr-defined]
        return 100.0

    shard = Shard(0, 1, ModeSettings("async", 2), now=now)
    shards.append(shard)
    shard.status()  # ConfigChanges.status reads the clock
    shard.join(0, 2, 1)  # ShardMembers.join touches the lease
    shard.expire_leases()
    assert owned and all(owned)


def test_the_calls_servicers_make_are_the_collaborators_own() -> None:
    shard = Shard(0, 1, ModeSettings("sync", 1))
    plan = make_plan([ParameterSpec("w", (4,), "float32")], 1, 16)
    DataPath.check_wire_dtype(plan, "float16")
    with pytest.raises(InvalidRequestError, match="not narrower"):
        DataPath.check_wire_dtype(plan, "float64")
    assert shard.push == shard.data_calls.push and shard.join_relaying == shard.relay.join_relaying
    assert shard.values_key() == (0, 0) and shard.table_metrics() == ([], 0)


def test_the_collaborators_state_shows_through_the_facade() -> None:
    shard = Shard(1, 2, ModeSettings("sync", 3))
    assert shard.membership is shard.cluster.membership and shard.epochs is shard.cluster.epochs
    assert shard.cluster.configured_num_workers == 3 and shard.num_workers == 3 and shard.pending_mode == ""
    assert shard.last_checkpoint_version is None
    shard.checkpointed(7)
    assert shard.last_checkpoint_version == 7
