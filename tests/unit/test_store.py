"""The parameter store's optimizer step: the same result as torch.optim, and all or nothing."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ps_common.errors import InvalidRequestError, NonFiniteUpdateError, UpdateRefusedError
from ps_common.optimizer import OptimizerSpec
from ps_common.partition import WirePartition
from ps_common.plan import ParameterSpec, make_plan
from ps_server.core.finite import all_finite
from ps_server.core.partitions import Bounded, match_partitions
from ps_server.shard.store import ParameterStore

PLAN = make_plan([ParameterSpec("w", (40,), "float32"), ParameterSpec("b", (8,), "float32")], 1, 64)


def store(name: str, **kwargs: float) -> ParameterStore:
    torch.manual_seed(0)
    values = [torch.randn(p.length) for p in PLAN.owned_by(0)]
    return ParameterStore(PLAN, 0, values, OptimizerSpec(name, {"lr": 0.1, **kwargs}))


def grads(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randn(p.length) * scale for p in PLAN.owned_by(0)]


def snapshot(s: ParameterStore) -> tuple[list[torch.Tensor], dict]:
    return [t.clone() for t in s.tensors], copy.deepcopy(s.optimizer.state_dict())


def assert_same(a: tuple[list[torch.Tensor], dict], b: tuple[list[torch.Tensor], dict]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    sa, sb = a[1]["state"], b[1]["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for name in sa[k]:
            x, y = sa[k][name], sb[k][name]
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


SGD_CONFIGS = [
    {},
    {"momentum": 0.9},
    {"momentum": 0.9, "nesterov": 1, "weight_decay": 0.01},
    {"momentum": 0.5, "dampening": 0.3, "weight_decay": 0.1},
]


@pytest.mark.parametrize("kwargs", SGD_CONFIGS)
def test_sgd_steps_are_bitwise_torch_optim_sgd(kwargs) -> None:
    s = store("sgd", **kwargs)
    ref = [t.clone() for t in s.tensors]
    opt = OptimizerSpec("sgd", {"lr": 0.1, **kwargs}).build(ref)
    for step in range(4):
        scale = 0.5 if step == 2 else 1.0
        g = grads(step)
        s.apply(g, lr_scale=scale)
        for t, gi in zip(ref, g, strict=True):
            t.grad = gi.clone()
        for group in opt.param_groups:
            group["lr"] = 0.1 * scale
        with torch.no_grad():
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(s.tensors, ref, strict=True)), step
    assert s.optimizer.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [("sgd", {}), ("sgd", {"momentum": 0.9}), ("adam", {}), ("adamw", {"weight_decay": 0.1}), ("rmsprop", {})],
)
def test_a_step_that_would_overflow_is_refused_and_changes_nothing(name, kwargs) -> None:
    s = store(name, **kwargs)
    s.apply(grads(0))  # optimizer state exists
    before = snapshot(s)
    with pytest.raises(NonFiniteUpdateError, match="unchanged"):
        s.apply(grads(1, scale=3e38) if name == "sgd" else [torch.full((p.length,), 3e38) for p in PLAN.owned_by(0)])
    assert_same(before, snapshot(s))
    s.apply(grads(2))  # the next step proceeds
    assert all_finite(s.tensors)


@pytest.mark.parametrize(("name", "kwargs"), [("sgd", {"momentum": 0.9}), ("adam", {})])
def test_a_first_step_refused_leaves_no_optimizer_state(name, kwargs) -> None:
    s = store(name, **kwargs)
    before = snapshot(s)
    with pytest.raises(NonFiniteUpdateError):
        s.apply([torch.full((p.length,), float("inf")) for p in PLAN.owned_by(0)])
    assert_same(before, snapshot(s))
    assert not s.optimizer.state


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_step_that_raises_is_undone(name) -> None:
    s = store(name, momentum=0.9) if name == "sgd" else store(name)
    s.apply(grads(0))
    before = snapshot(s)
    s.optimizer.param_groups[0]["lr"] = 1e308  # behind the validation's back: float32 cannot hold it
    with pytest.raises(UpdateRefusedError) as refused:  # raised by torch (sgd), or inf (adam's scalar math)
        s.apply(grads(1))
    assert "nothing was applied" in str(refused.value) or isinstance(refused.value, NonFiniteUpdateError)
    assert_same(before, snapshot(s))


def test_a_step_with_zero_gradients_and_a_huge_rate_is_refused_whole() -> None:
    s = store("sgd")
    s.apply(grads(0))
    before = snapshot(s)
    s.optimizer.param_groups[0]["lr"] = 1e308  # lr * 0 is in range; the rate itself is not
    with pytest.raises(UpdateRefusedError):
        s.apply([torch.zeros(p.length) for p in PLAN.owned_by(0)])
    assert_same(before, snapshot(s))


def test_optimizer_arguments_beyond_the_dtype_range_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="float32"):
        ParameterStore(PLAN, 0, grads(0), OptimizerSpec("sgd", {"lr": 1e39}))
    with pytest.raises(InvalidRequestError, match="lr \\* weight_decay"):
        ParameterStore(PLAN, 0, grads(0), OptimizerSpec("adamw", {"lr": 1e20, "weight_decay": 1e20}))
    half = make_plan([ParameterSpec("h", (4,), "float16")], 1, 64)
    with pytest.raises(InvalidRequestError, match="float16"):
        ParameterStore(half, 0, [torch.zeros(4)], OptimizerSpec("sgd", {"lr": 1e5}))


def test_all_finite_is_exact_when_a_sum_overflows() -> None:
    assert all_finite([torch.full((4,), 3e38)])  # the sum overflows; every value is finite
    assert not all_finite([torch.tensor([1.0, float("nan")])])
    assert not all_finite([torch.tensor([float("inf"), float("-inf")])])
    assert all_finite([torch.full((4,), 60000.0, dtype=torch.float16), torch.zeros(0), torch.arange(3)])


def test_a_known_gradient_bound_replaces_the_steps_own_read() -> None:
    """The bound found when the gradients arrived (Bounded) is the one the SGD proof uses: a true
    bound gives the same bits as reading them; a bound too close to float32's range sends the
    step through the copied-and-checked path, and a real overflow is still refused whole."""
    plain, bounded = store("sgd", momentum=0.9), store("sgd", momentum=0.9)
    for step in range(3):
        g = grads(step)
        plain.apply(g)
        bounded.apply(Bounded(g, max(float(t.norm()) for t in g)))
    assert all(torch.equal(a, b) for a, b in zip(plain.tensors, bounded.tensors, strict=True))
    g = grads(4)
    assert bounded._sgd_stays_finite(g, 1.0) is not None  # read: provably finite
    assert bounded._sgd_stays_finite(g, 1.0, known=3e38) is None  # the known bound is what counts
    before = snapshot(bounded)
    with pytest.raises(NonFiniteUpdateError):
        bounded.apply(Bounded(grads(5, scale=3e38), 3e38 * 10))
    assert_same(before, snapshot(bounded))


def test_match_partitions_carries_the_finite_checks_bound() -> None:
    values = {"w": torch.tensor([3.0, -4.0] + [0.0] * 38), "b": torch.full((8,), 0.5)}

    def wire(dtype: torch.dtype, name: str) -> list[WirePartition]:
        out = []
        for p in PLAN.owned_by(0):
            chunk = values[p.key][p.offset : p.offset + p.length].to(dtype)
            out.append(WirePartition(p.key, p.offset, p.length, name, chunk.view(torch.uint8).numpy().tobytes()))
        return out

    got = match_partitions(PLAN, 0, wire(torch.float32, "float32"), "gradient")
    assert isinstance(got, Bounded) and got.max_abs == pytest.approx(5.0)  # the largest L2 norm
    assert got.max_abs >= max(float(t.abs().max()) for t in got)
    narrow = match_partitions(PLAN, 0, wire(torch.bfloat16, "bfloat16"), "gradient")
    assert narrow.max_abs == math.inf  # bf16's check finds no bound: the step reads them itself
