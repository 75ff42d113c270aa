"""DataPath on its own: plan checks, Init's plan, refusals and their bookkeeping, over a fake host
standing for the shard facade (no lock exists). The whole path through the policies is in
test_shard.py and test_consistency_contract.py."""

from __future__ import annotations

from typing import Any

import pytest

from ps_common.errors import InvalidRequestError, NonFiniteUpdateError, NotInitializedError, PlanMismatchError
from ps_common.modes import ModeSettings
from ps_common.plan import ParameterSpec, make_plan, plan_digest
from ps_server.core.limits import Limits
from ps_server.membership.ranks import Membership, PushResult, PushStamp
from ps_server.policy.sync import SyncRounds
from ps_server.shard.counters import ShardCounters
from ps_server.shard.data import DataPath

SPECS = [ParameterSpec("w", (6,), "float32")]
PLAN = make_plan(SPECS, 2, 16)


class Host:
    """What DataPath reads of a shard (DataHost), the parts these tests reach."""

    def __init__(self) -> None:
        self.shard_index, self.num_shards, self.limits = 0, 2, Limits()
        self.plan: Any = None
        self.store: Any = None
        self.version = 4
        self.rounds = SyncRounds(round=5)
        self.refused_at: int | None = None
        self.refusals: dict = {}
        self.counters = ShardCounters()
        self.membership = Membership(2, 5.0, lambda: 0.0, 0.0)
        self.settings = ModeSettings()


def test_the_plan_is_checked_before_anything() -> None:
    host = Host()
    data = DataPath(host)  # type: ignore[arg-type]
    with pytest.raises(NotInitializedError, match="rank 0 must call Init"):
        data.check_plan(PLAN.digest)
    host.plan = PLAN
    assert data.check_plan(PLAN.digest) is PLAN
    with pytest.raises(InvalidRequestError, match="plan_digest is empty"):
        data.check_plan("")
    with pytest.raises(PlanMismatchError, match="does not match"):
        data.check_plan("0" * 64)
    assert data.initialized(PLAN.digest) == (False, 4, PLAN.digest)


def test_init_checks_the_shard_count_and_the_digest_before_building_the_plan() -> None:
    data = DataPath(Host())  # type: ignore[arg-type]
    digest = plan_digest(SPECS, 2, 16)
    assert data.init_plan(SPECS, 2, 16, digest).digest == PLAN.digest
    with pytest.raises(InvalidRequestError, match="this cluster has 2"):
        data.init_plan(SPECS, 3, 16, digest)
    with pytest.raises(InvalidRequestError, match="does not match its own specs"):
        data.init_plan(SPECS, 2, 16, "f" * 64)


def test_a_wire_dtype_wider_than_the_parameters_is_refused() -> None:
    DataPath.check_wire_dtype(PLAN, "")
    DataPath.check_wire_dtype(PLAN, "bfloat16")
    with pytest.raises(InvalidRequestError, match="not narrower"):
        DataPath.check_wire_dtype(PLAN, "float64")


def test_a_refused_round_reopens_and_leaves_each_rank_its_refusal() -> None:
    host = Host()
    data = DataPath(host)  # type: ignore[arg-type]
    member = host.membership.members[1]
    data.record(member, PushStamp(1, 1, 4), PushResult(5, 0, False, False, "sync"))
    assert member.clock == 5 and member.pushes == 1 and (1, 4) in member.history
    data.refuse_round({0: [], 1: []}, NonFiniteUpdateError("a NaN in w."))
    assert host.rounds.round == 4 and host.refused_at == 4
    assert (1, 4) not in member.history and member.clock == 4
    assert set(host.refusals) == {0, 1} and "refused round 4 (ranks [0, 1]) as a whole" in str(host.refusals[1])
    assert host.counters.view().rejected_pushes == {"non_finite_update": 2}
