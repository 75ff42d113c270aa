"""The Shard facade: the one object that takes a shard's lock, over its collaborators."""

from __future__ import annotations

import threading

import pytest
import torch

from ps_common.errors import InvalidRequestError, NotJoinedError
from ps_common.modes import ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_common.partition import WirePartition
from ps_common.plan import ParameterSpec, make_plan
from ps_server.shard.data import DataPath
from ps_server.shard.shard import PushStamp, Shard
from ps_server.shard.views import clone_tensors
from tests.helpers.tensors import encode


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


class CountingCondition(threading.Condition):
    """The shard's condition, counting how often its lock is taken with ``with``."""

    entered = 0

    def __enter__(self) -> bool:
        self.entered += 1
        return super().__enter__()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_steps_header_check_push_and_read_take_the_lock_once(mode: str) -> None:
    """A PushPull of a rank with its current session: the header (plan and session) is checked without
    the lock, the push and the read of its answer in one hold (docs/architecture.md#7-gradient-path).
    A session that is not current is checked under the lock and refused there."""
    specs = [ParameterSpec("w", (4,), "float32")]
    plan = make_plan(specs, 1, 16)
    shard = Shard(0, 1, ModeSettings(mode, 1))
    session = shard.join(0, 1, 1).session
    parts = [WirePartition("w", 0, 4, "float32", encode(torch.zeros(4)))]
    shard.init(specs, 1, 16, plan.digest, OptimizerSpec("sgd", {"lr": 0.5}), parts)
    shard._cond.__class__ = CountingCondition  # type: ignore[assignment]
    grads = [WirePartition("w", 0, 4, "float32", encode(torch.ones(4)))]
    assert shard.check_request(plan.digest, 0, 1, session, "PushPull") is shard.plan
    _, version, out, _ = shard.push_pull(PushStamp(0, 1, 0), 0, plan, grads, 10.0, clone_tensors)
    assert shard._cond.entered == 1  # type: ignore[attr-defined]
    assert version == 1 and [t.tolist() for t in out] == [[-0.5] * 4]
    with pytest.raises(NotJoinedError, match="not its current one"):
        shard.check_request(plan.digest, 0, 1, session + 1, "PushPull")
    assert shard._cond.entered == 2  # type: ignore[attr-defined]
