"""StateCodec on its own: a shard's state as plain data and back, no shard and no lock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ps_common.errors import CheckpointError, NotInitializedError
from ps_common.modes import ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_common.plan import ParameterSpec, make_plan
from ps_server.membership.epochs import Epochs
from ps_server.membership.ranks import Membership
from ps_server.policy.sync import SyncRounds
from ps_server.shard.state import StateCodec
from ps_server.shard.store import ParameterStore
from ps_server.tables.store import TableStore

PLAN = make_plan([ParameterSpec("w", (4,), "float32")], 1, 16)


class Held:
    """What StateCodec.export reads of a shard (``Held.export``)."""

    def __init__(self, initialized: bool = True) -> None:
        values = [torch.arange(4, dtype=torch.float32)]
        self.plan = PLAN if initialized else None
        self.store = ParameterStore(PLAN, 0, values, OptimizerSpec("sgd", {"lr": 0.1})) if initialized else None
        self.version = 3
        self.rounds = SyncRounds(round=3)
        self.tables = TableStore(0, 1, 1000)
        self.mode = ModeSettings("sync", 2).mode
        self.membership = Membership(2, 5.0, lambda: 0.0, 0.0)
        self.epochs = Epochs(authority=True, num_workers=2, key="", cluster_id="c1")
        self.cluster = SimpleNamespace(configured_num_workers=2, membership=self.membership, epochs=self.epochs)

    def export(self, codec: StateCodec) -> dict:
        what = (self.plan, self.store, self.version, self.mode, self.rounds, self.cluster, self.tables)
        return codec.export(*what)  # type: ignore[arg-type]


def test_the_state_goes_out_as_plain_data_and_comes_back() -> None:
    codec = StateCodec(0, 1)
    state = Held().export(codec)
    assert state["version"] == 3 and state["mode"] == "sync" and state["configured_num_workers"] == 2
    assert "tables" not in state  # none were declared
    plan, store = codec.load(state)
    assert plan.digest == PLAN.digest and torch.equal(store.tensors[0], torch.arange(4, dtype=torch.float32))
    other = Held()
    codec.restore(state, other.membership, other.epochs, other.tables)
    assert other.epochs.cluster_id == "c1"


def test_nothing_to_export_before_init() -> None:
    with pytest.raises(NotInitializedError, match="before Init"):
        Held(initialized=False).export(StateCodec(0, 1))


def test_a_checkpoint_of_another_shard_count_is_refused() -> None:
    state = Held().export(StateCodec(0, 1))
    with pytest.raises(CheckpointError, match="same --num-shards"):
        StateCodec(0, 2).load(state)
