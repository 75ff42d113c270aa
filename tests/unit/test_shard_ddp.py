"""DDP semantics in the shard without gRPC: per-step hyperparameters, parameter groups, skipped
rounds, buffers, and their checkpoints."""

from __future__ import annotations

import io

import pytest
import torch

from ps_common import frames
from ps_common.errors import HyperparametersDisagreeError, InvalidRequestError, UpdateRefusedError
from ps_common.modes import ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_common.partition import WirePartition
from ps_common.plan import ParameterSpec, make_plan
from ps_server.policy.sync import agreed_hyperparameters
from ps_server.service.frame_cache import FrameCache
from ps_server.shard.shard import PushStamp, Shard
from ps_server.shard.store import ParameterStore
from tests.helpers.tensors import encode

SPECS = [ParameterSpec("w", (4,), "float32"), ParameterSpec("b", (2,), "float32"), ParameterSpec("m", (2,), "float32")]
PLAN = make_plan(SPECS, 1, 1 << 20)
GROUPED = OptimizerSpec("sgd", {"lr": 0.5, "weight_decay": 0.1}, ((("b",), {"weight_decay": 0.0}),), ("m",))


def wire(values: dict[str, float]) -> list[WirePartition]:
    return [
        WirePartition(p.key, p.offset, p.length, "float32", encode(torch.full((p.length,), values[p.key])))
        for p in PLAN.owned_by(0)
    ]


def shard(num_workers: int = 2, mode: str = "sync") -> Shard:
    s = Shard(0, 1, ModeSettings(mode=mode, num_workers=num_workers))
    for r in range(num_workers):
        s.join(r, num_workers, 1)
    s.init(SPECS, 1, 1 << 20, PLAN.digest, GROUPED, wire({"w": 1.0, "b": 1.0, "m": 0.0}))
    return s


def values(s: Shard) -> dict[str, float]:
    _, out = s.pull(0, 1, 0, PLAN.digest, timeout=1.0, encode=FrameCache().encoder())
    return {p.key: frames.view(p)[0].item() for raw in out for p in frames.read(raw).partitions}


def test_spec_groups_and_buffers_are_validated() -> None:
    with pytest.raises(InvalidRequestError, match="more than one optimizer group"):
        OptimizerSpec("sgd", {"lr": 0.1}, ((("w",), {}), (("w",), {})))
    with pytest.raises(InvalidRequestError, match="both as a buffer"):
        OptimizerSpec("sgd", {"lr": 0.1}, ((("m",), {}),), ("m",))
    with pytest.raises(InvalidRequestError, match="takes no argument"):
        OptimizerSpec("sgd", {"lr": 0.1}, ((("w",), {"betas": 0.5}),))
    assert GROUPED.group_of(["w", "b", "x"]) == [0, 1, 0]
    with pytest.raises(InvalidRequestError, match="not 'nesterov'"):
        GROUPED.check_hyperparameters([{"lr": 0.1}, {"nesterov": 1}], 2)
    with pytest.raises(InvalidRequestError, match="for 1 parameter groups but the shard's sgd optimizer has 2"):
        GROUPED.check_hyperparameters([{"lr": 0.1}], 2)


def test_agreed_hyperparameters() -> None:
    assert agreed_hyperparameters({0: [{"lr": 0.1}], 1: [{"lr": 0.1}]}) == [{"lr": 0.1}]
    assert agreed_hyperparameters({0: [{"lr": 0.1}], 1: [{"lr": 0.2}]}) is None
    assert agreed_hyperparameters({0: (), 1: ()}) == ()


def test_store_per_group_step_buffers_and_refused_step_keeps_hyperparameters() -> None:
    store = ParameterStore(PLAN, 0, [torch.ones(4), torch.ones(2), torch.zeros(2)], GROUPED)
    assert len(store.optimizer.param_groups) == 2 and store.trained_index == [0, 1]
    grads = [torch.zeros(4), torch.zeros(2), torch.full((2,), 7.0)]
    store.apply(grads, hyper=[{"lr": 1.0}, {"lr": 1.0}], buffers=grads)
    assert store.tensors[0][0].item() == pytest.approx(1 - 1.0 * 0.1)  # decayed
    assert store.tensors[1][0].item() == 1.0  # no decay on the bias group
    assert store.tensors[2][0].item() == 7.0  # the buffer took the pushed value
    assert [g["lr"] for g in store.optimizer.param_groups] == [1.0, 1.0]  # kept after the step
    before = [t.clone() for t in store.tensors]
    with pytest.raises(UpdateRefusedError):
        store.apply([torch.full((4,), 3e38), torch.zeros(2), torch.zeros(2)], hyper=[{"lr": 1e30}, {"lr": 0.5}])
    assert [g["lr"] for g in store.optimizer.param_groups] == [1.0, 1.0]
    assert all(torch.equal(a, b) for a, b in zip(before, store.tensors, strict=True))


def test_sync_round_uses_the_agreed_lr_refuses_disagreement_and_skips_on_any_skip() -> None:
    s = shard()
    hyper = [{"lr": 0.1}, {"lr": 0.1}]
    s.push(PushStamp(0, 1, 0), 0, PLAN, wire({"w": 1.0, "b": 1.0, "m": 5.0}), hyper)
    s.push(PushStamp(1, 1, 0), 0, PLAN, wire({"w": 3.0, "b": 3.0, "m": 9.0}), hyper)
    v = values(s)
    assert v["w"] == pytest.approx(1 - 0.1 * (2.0 + 0.1))  # lr 0.1 (not the spec's 0.5), decay 0.1
    assert v["b"] == pytest.approx(1 - 0.1 * 2.0)
    assert v["m"] == 5.0  # rank 0's buffer, not the mean
    assert s.learning_rate() == pytest.approx(0.1)
    # disagreement: the round is refused as a whole, both ranks are told, nothing changed
    s.push(PushStamp(0, 1, 1), 1, PLAN, wire({"w": 1.0, "b": 1.0, "m": 6.0}), hyper)
    with pytest.raises(HyperparametersDisagreeError, match="different hyperparameters"):
        s.push(PushStamp(1, 1, 1), 1, PLAN, wire({"w": 1.0, "b": 1.0, "m": 6.0}), [{"lr": 0.2}, {"lr": 0.1}])
    assert s.version == 1 and values(s) == v
    # a skip from any rank: the round closes, the step is skipped, rank 0's buffers still arrive
    s.push(PushStamp(0, 1, 1), 1, PLAN, wire({"w": 1.0, "b": 1.0, "m": 6.0}), hyper)
    s.push(PushStamp(1, 1, 1), 1, PLAN, wire({"w": 0.0, "b": 0.0, "m": 0.0}), hyper, skip=True)
    assert s.version == 2 and 1 in s.skipped_rounds
    after = values(s)
    assert after["w"] == v["w"] and after["b"] == v["b"] and after["m"] == 6.0


def test_update_config_lr_holds_until_a_push_changes_it() -> None:
    s = shard(num_workers=1, mode="async")
    s.update_config(learning_rate=0.01, at_version=0)  # from this version on
    s.push(PushStamp(0, 1, 0), 0, PLAN, wire({"w": 1.0, "b": 0.0, "m": 0.0}))
    assert values(s)["w"] == pytest.approx(1 - 0.01 * (1.0 + 0.1))
    s.push(PushStamp(0, 1, 1), 1, PLAN, wire({"w": 0.0, "b": 0.0, "m": 0.0}), [{"lr": 0.3}, {"lr": 0.3}])
    assert s.learning_rate() == pytest.approx(0.3)
    # the latest change wins: the operator's lr holds while the pushed lr stays the same...
    s.update_config(learning_rate=0.02)
    s.push(PushStamp(0, 1, 2), 2, PLAN, wire({"w": 0.0, "b": 0.0, "m": 0.0}), [{"lr": 0.3}, {"lr": 0.3}])
    assert s.learning_rate() == pytest.approx(0.02)
    # ...until the worker's schedule changes it
    s.push(PushStamp(0, 1, 3), 3, PLAN, wire({"w": 0.0, "b": 0.0, "m": 0.0}), [{"lr": 0.4}, {"lr": 0.3}])
    assert [g["lr"] for g in s.store.optimizer.param_groups] == [0.4, 0.02]  # type: ignore[union-attr]


def test_checkpoint_keeps_groups_buffers_and_scheduled_lr_and_old_checkpoints_load() -> None:
    s = shard(num_workers=1)
    s.push(PushStamp(0, 1, 0), 0, PLAN, wire({"w": 1.0, "b": 1.0, "m": 4.0}), [{"lr": 0.2}, {"lr": 0.05}])
    state = s.export_state()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    restored = Shard(0, 1, ModeSettings(mode="sync", num_workers=1))
    restored.restore(loaded)
    assert restored.store is not None
    assert restored.store.optimizer_spec == s.store.optimizer_spec  # type: ignore[union-attr]
    assert [g["lr"] for g in restored.store.optimizer.param_groups] == [0.2, 0.05]
    assert values(restored) == values(s)
    old = dict(loaded, optimizer={"name": "sgd", "kwargs": {"lr": 0.5}})  # written before groups existed
    old["optimizer_state"] = {
        "state": {},
        "param_groups": [dict(loaded["optimizer_state"]["param_groups"][0], params=[0, 1, 2])],
    }
    legacy = Shard(0, 1, ModeSettings(mode="sync", num_workers=1))
    legacy.restore(old)
    assert (
        legacy.store is not None
        and legacy.store.optimizer_spec.groups == ()
        and legacy.store.trained_index == [0, 1, 2]
    )


def test_async_buffers_come_from_rank_0_only_even_when_it_skips() -> None:
    s = shard(num_workers=2, mode="async")
    s.push(PushStamp(1, 1, 0), 0, PLAN, wire({"w": 0.0, "b": 0.0, "m": 9.0}))
    assert values(s)["m"] == 0.0  # rank 1's buffers are not kept
    s.push(PushStamp(0, 1, 0), 1, PLAN, wire({"w": 0.0, "b": 0.0, "m": 4.0}), skip=True)
    assert values(s)["m"] == 4.0 and s.version == 2  # a skipped push still brings rank 0's buffers (a version)
