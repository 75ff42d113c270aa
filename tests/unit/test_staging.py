"""ps_worker.staging: CPU tensors are viewed in place, never copied; a pull writes in place (no sockets)."""

from __future__ import annotations

import pytest
import torch

from ps_common.plan import make_plan
from ps_worker.planning import model_specs
from ps_worker.staging import HostStaging

TENSORS = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
PLAN = make_plan(model_specs(list(TENSORS.items())), 1)


def test_cpu_tensors_are_staged_as_views_in_plan_order() -> None:
    flats = HostStaging().stage(PLAN, TENSORS)
    assert list(flats) == [s.key for s in PLAN.specs]
    assert all(flats[k].data_ptr() == t.data_ptr() and flats[k].dim() == 1 for k, t in TENSORS.items())


def test_every_key_of_the_plan_is_needed() -> None:
    with pytest.raises(KeyError, match="missing \\['b'\\]"):
        HostStaging().stage(PLAN, {"w": TENSORS["w"]})


def test_a_pull_writes_in_place_and_refuses_non_contiguous_cpu_tensors() -> None:
    flats, device_out = HostStaging().pull_targets(PLAN, TENSORS)
    assert not device_out and flats["w"].data_ptr() == TENSORS["w"].data_ptr()
    with pytest.raises(ValueError, match="contiguous"):
        HostStaging().pull_targets(PLAN, {"w": torch.zeros(3, 2).t(), "b": torch.ones(3)})
