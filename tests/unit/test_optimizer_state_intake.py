"""A shard's optimizer-state intake (ps_server.shard.optimizer_state): every value checked as it
arrives, a partial state refused, and a committed state stepping as torch does."""

from __future__ import annotations

import pytest
import torch

from ps_common.codec import dtype_to_proto
from ps_common.errors import InvalidRequestError
from ps_common.optimizer import OptimizerSpec
from ps_common.plan import ParameterSpec, make_plan
from ps_proto.v1 import ps_pb2
from ps_server.shard.optimizer_state import Layout, StateIntake, state_names
from ps_server.shard.store import ParameterStore

PLAN = make_plan([ParameterSpec("w", (40,), "float32"), ParameterSpec("bn", (8,), "float32")], 1, 64)


def store(name: str = "adam", **kwargs: float) -> ParameterStore:
    values = [torch.zeros(p.length) for p in PLAN.owned_by(0)]
    return ParameterStore(PLAN, 0, values, OptimizerSpec(name, {"lr": 0.1, **kwargs}, buffers=("bn",)))


def value(key: str, offset: int, name: str, t: torch.Tensor, dtype: str = "float32") -> ps_pb2.OptimizerStateValue:
    return ps_pb2.OptimizerStateValue(
        key=key,
        offset=offset,
        name=name,
        dtype=dtype_to_proto(dtype),
        scalar=t.dim() == 0,
        data=t.reshape(-1).view(torch.uint8).numpy().tobytes(),
    )


def full_state(s: ParameterStore, fill: float) -> list[ps_pb2.OptimizerStateValue]:
    out = []
    for p in s.partitions:
        if p.key == "w":
            out.append(value("w", p.offset, "step", torch.tensor(3.0)))
            out.append(value("w", p.offset, "exp_avg", torch.full((p.length,), fill)))
            out.append(value("w", p.offset, "exp_avg_sq", torch.full((p.length,), fill * fill)))
    return out


def test_state_names_come_from_the_optimizer_class_and_group() -> None:
    assert set(state_names(store("sgd").optimizer, 0)) == {""}
    assert set(state_names(store("sgd", momentum=0.9).optimizer, 0)) == {"", "momentum_buffer"}
    assert set(state_names(store("adamw", amsgrad=1).optimizer, 0)) == {
        "",
        "step",
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
    }


@pytest.mark.parametrize(
    "bad, match",
    [
        (value("w", 3, "exp_avg", torch.zeros(16)), "names no partition"),
        (value("bn", 0, "exp_avg", torch.zeros(8)), "buffer"),
        (value("w", 0, "momentum_buffer", torch.zeros(16)), "keeps"),
        (value("w", 0, "exp_avg", torch.zeros(15)), "bytes"),
        (value("w", 0, "exp_avg", torch.zeros(16, dtype=torch.float64), "float64"), "float64"),
        (value("w", 0, "step", torch.zeros(16)), "scalar"),
        (value("w", 0, "exp_avg", torch.full((16,), float("nan"))), "NaN|finite"),
    ],
)
def test_a_value_that_does_not_fit_is_refused(bad: ps_pb2.OptimizerStateValue, match: str) -> None:
    intake = StateIntake(Layout(PLAN, 0, store()))
    with pytest.raises(InvalidRequestError, match=match):
        intake.add(bad)


def test_a_value_twice_and_a_partial_partition_are_refused() -> None:
    s = store()
    intake = StateIntake(Layout(PLAN, 0, s))
    intake.add(value("w", 0, "exp_avg", torch.zeros(16)))
    with pytest.raises(InvalidRequestError, match="twice"):
        intake.add(value("w", 0, "exp_avg", torch.zeros(16)))
    with pytest.raises(InvalidRequestError, match="step, exp_avg_sq|exp_avg_sq, step"):
        intake.finish()


def test_a_committed_state_steps_as_torch_with_that_state() -> None:
    s = store()
    intake = StateIntake(Layout(PLAN, 0, s))
    for v in full_state(s, 0.5):
        intake.add(v)
    s.replace_state(intake.finish())
    grads = [torch.linspace(-1, 1, p.length) for p in s.partitions]
    s.apply(grads)

    w = torch.zeros(40, requires_grad=True)
    ref = torch.optim.Adam([w], lr=0.1)
    ref.state[w] = {"step": torch.tensor(3.0), "exp_avg": torch.full((40,), 0.5), "exp_avg_sq": torch.full((40,), 0.25)}
    w.grad = torch.cat([g for g, p in zip(grads, s.partitions, strict=True) if p.key == "w"])
    ref.step()
    got = torch.cat([t for t, p in zip(s.tensors, s.partitions, strict=True) if p.key == "w"])
    assert torch.equal(got, w.detach())
    s.replace_state({})  # no state: as before the first step
    assert not s.optimizer.state
