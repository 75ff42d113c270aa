"""Every server optimizer in the parameter store: a streamed round's slot-by-slot steps are bitwise
the whole step (values and state), an undo puts the state back, a checkpoint (export_state, then
torch.save/load weights_only, then load_state) resumes bitwise, and a step that would make the
state non-finite is refused whole."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from ps_common.errors import NonFiniteUpdateError
from ps_common.optimizer import OptimizerSpec
from ps_common.plan import ParameterSpec, make_plan
from ps_server.membership.ranks import Membership
from ps_server.shard.state import export_state, load_state
from ps_server.shard.store import ParameterStore
from tests.helpers.optimizer_cases import CASES

# 64-byte partitions: the weight's 40 elements split in 3, the bias is one
PLAN = make_plan([ParameterSpec("2.weight", (40,), "float32"), ParameterSpec("2.bias", (8,), "float32")], 1, 64)


def spec_of(case_id: str) -> OptimizerSpec:
    """The case's spec, its groups cut to this plan's keys."""
    name, kwargs, groups = CASES[case_id].server_spec()
    keys = {s.key for s in PLAN.specs}
    cut = tuple((tuple(k for k in ks if k in keys), kw) for ks, kw in groups)
    return OptimizerSpec(name, kwargs, tuple((ks, kw) for ks, kw in cut if ks))


def make_store(case_id: str) -> ParameterStore:
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(p.length, generator=g) for p in PLAN.owned_by(0)]
    return ParameterStore(PLAN, 0, values, spec_of(case_id))


def grads(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.length, generator=g) * scale for p in PLAN.owned_by(0)]


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
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (k, name)
    assert a[1]["param_groups"] == b[1]["param_groups"]


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_slot_steps_are_bitwise_the_whole_step_and_an_undo_puts_the_state_back(case_id: str) -> None:
    streamed, whole = make_store(case_id), make_store(case_id)
    assert len(streamed.tensors) > 2
    for step in range(7):  # RAdam rectifies from step 6 on; ASGD averages after t0
        g = grads(step)
        before = snapshot(streamed)
        for i in reversed(range(len(g))):
            streamed.step_slot(i, g[i])
        streamed.undo_slots()
        assert_same(before, snapshot(streamed))
        for i in reversed(range(len(g))):
            streamed.step_slot(i, g[i])
        streamed.commit_slots()
        whole.apply(g)
        assert_same(snapshot(streamed), snapshot(whole))


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_a_checkpoint_of_the_store_resumes_bitwise(case_id: str) -> None:
    s = make_store(case_id)
    for step in range(3):
        s.apply(grads(step))
    buf = io.BytesIO()
    torch.save(export_state(PLAN, s, 3, "sync", Membership(1, 5.0, lambda: 0.0, 0.0)), buf)
    buf.seek(0)
    _, resumed = load_state(torch.load(buf, weights_only=True), 0, 1)
    assert resumed.optimizer_spec == s.optimizer_spec
    assert_same(snapshot(resumed), snapshot(s))
    for step in range(3, 7):
        s.apply(grads(step))
        resumed.apply(grads(step))
    assert_same(snapshot(resumed), snapshot(s))


HUGE = 3e38  # finite in float32; its square, or 10 times it, is not


@pytest.mark.parametrize(
    ("name", "kwargs", "edge"),
    [
        ("adadelta", {"lr": 1.0}, False),  # square_avg overflows
        ("nadam", {"lr": 0.01}, False),  # exp_avg_sq overflows
        ("radam", {"lr": 0.01}, False),
        ("asgd", {"lr": 10.0, "t0": 0}, False),  # the parameter (lr * grad) overflows
        ("rprop", {"lr": HUGE, "step_size_max": HUGE}, True),  # a parameter at 3e38 moves outward by 3e38
        ("adamax", {"lr": HUGE, "beta1": 0.0}, True),  # likewise (beta1 0: no bias correction to overflow lr)
    ],
)
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "slot"])
def test_a_step_that_makes_the_state_non_finite_is_refused_and_changes_nothing(name, kwargs, edge, streamed) -> None:
    """``edge``: parameters at +-3e38 and a unit gradient pushing them outward; else a 3e38 gradient."""
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(p.length, generator=g) for p in PLAN.owned_by(0)]
    if edge:
        values = [torch.sign(v) * HUGE for v in values]
    s = ParameterStore(PLAN, 0, values, OptimizerSpec(name, kwargs))
    zeros = [torch.zeros(p.length) for p in PLAN.owned_by(0)]
    s.apply(zeros if edge else [torch.full((p.length,), 1e-3) for p in PLAN.owned_by(0)])  # state exists
    before = snapshot(s)
    bad = [-torch.sign(v) if edge else torch.full(v.shape, HUGE) for v in s.tensors]
    with pytest.raises(NonFiniteUpdateError, match="unchanged"):
        if streamed:
            s.step_slot(0, bad[0])
        else:
            s.apply(bad)
    if streamed:
        s.undo_slots()
    assert_same(before, snapshot(s))
    s.apply(zeros)  # the next step proceeds
    assert s.optimizer.state


def test_a_pushed_pair_element_reaches_torch_s_tuple_and_a_refused_step_restores_it() -> None:
    s = make_store("rprop")
    s.apply(grads(0), hyper=[{"eta_plus": 1.1, "step_size_max": 0.05}])
    group = s.optimizer.param_groups[0]
    assert group["etas"] == (0.4, 1.1) and group["step_sizes"] == (1e-5, 0.05)
    with pytest.raises(NonFiniteUpdateError):
        s.apply([torch.full((p.length,), float("nan")) for p in PLAN.owned_by(0)], hyper=[{"eta_minus": 0.2}])
    assert group["etas"] == (0.4, 1.1)
