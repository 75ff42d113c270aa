"""Async, SSP and EASGD policies against references written from the papers' equations."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_common.errors import InvalidRequestError, NonFiniteUpdateError, StalePushError, WaitTimeoutError
from ps_common.modes import ModeSettings
from ps_server.policy import asynchronous, easgd, ssp
from ps_server.policy.sync import SyncRounds
from ps_server.service.frame_cache import encode_exchange
from ps_server.shard.shard import PushStamp

# ---------------------------------------------------------------- async (Zhang et al. 2016)


@pytest.mark.parametrize(("now", "grad", "tau"), [(5, 5, 0), (7, 5, 2), (3, 9, 0)])
def test_staleness_is_versions_since_the_pull(now: int, grad: int, tau: int) -> None:
    assert asynchronous.staleness(now, grad) == tau


def test_refusal_is_exact_at_the_bound() -> None:
    asynchronous.check_staleness(1, 1)
    asynchronous.check_staleness(100, -1)
    with pytest.raises(StalePushError, match="2 versions stale, more than --max-staleness 1"):
        asynchronous.check_staleness(2, 1)
    with pytest.raises(StalePushError):
        asynchronous.check_staleness(1, 0)


@pytest.mark.parametrize(("tau", "scale"), [(0, 1.0), (1, 1.0), (2, 0.5), (4, 0.25)])
def test_inverse_staleness_learning_rate(tau: int, scale: float) -> None:
    assert asynchronous.lr_scale(tau, "inverse") == scale
    assert asynchronous.lr_scale(tau, "") == 1.0


def test_scaled_step_equals_plain_sgd_with_the_scaled_rate() -> None:
    from ps_common.optimizer import OptimizerSpec
    from ps_common.plan import ParameterSpec, make_plan
    from ps_server.shard.store import ParameterStore

    plan = make_plan([ParameterSpec("w", (4,), "float32")], 1)
    store = ParameterStore(plan, 0, [torch.ones(4)], OptimizerSpec("sgd", {"lr": 0.4}))
    store.apply([torch.full((4,), 2.0)], lr_scale=asynchronous.lr_scale(4, "inverse"))
    assert torch.equal(store.tensors[0], torch.full((4,), 1.0 - 0.1 * 2.0))
    assert store.optimizer.param_groups[0]["lr"] == 0.4  # restored after the step


# ---------------------------------------------------------------- SSP (Ho et al. 2013)


def test_ssp_read_condition() -> None:
    assert ssp.can_read(5, [5, 3], 2)
    assert not ssp.can_read(6, [6, 3], 2)
    assert ssp.can_read(3, [3, 3], 0)
    assert not ssp.can_read(4, [4, 3], 0)  # s = 0 is BSP's read barrier
    assert ssp.can_read(9, [], 0)
    assert ssp.read_gap(6, [6, 4]) == 2 and ssp.read_gap(3, [3, 5]) == 0


def shard_for(mode: str, n: int, **kw: object):
    from ps_common.optimizer import OptimizerSpec
    from ps_common.partition import WirePartition
    from ps_common.plan import ParameterSpec, make_plan
    from ps_server.shard.shard import Shard
    from tests.helpers.tensors import encode

    plan = make_plan([ParameterSpec("w", (3,), "float32")], 1)
    shard = Shard(0, 1, ModeSettings(mode, num_workers=n, **kw))

    def wire(x: torch.Tensor) -> list[WirePartition]:
        return [WirePartition("w", 0, 3, "float32", encode(x))]

    for r in range(n):
        shard.join(r, n, 1)
    shard.init(
        plan.specs, 1, plan.partition_bytes, plan.digest, OptimizerSpec("sgd", {"lr": 0.1}), wire(torch.zeros(3))
    )
    return shard, plan, wire


@settings(max_examples=60, deadline=None)
@given(
    s=st.integers(0, 3),
    n=st.integers(2, 4),
    schedule=st.lists(st.integers(0, 3), min_size=10, max_size=80),
)
def test_ssp_gap_never_exceeds_s_under_random_schedules(s: int, n: int, schedule: list[int]) -> None:
    """Workers alternate pull -> push; the schedule says who tries to move next. A pull that may
    not be served now is refused (timeout 0) and that worker stays blocked until it can read."""
    shard, plan, wire = shard_for("ssp", n, staleness=s)
    pulled = [False] * n
    reads = 0
    for r in (x % n for x in schedule):
        if not pulled[r]:
            clocks = [m.clock for m in shard.members]
            try:
                shard.pull(r, 1, 0, plan.digest, timeout=0.0)
            except WaitTimeoutError:
                assert clocks[r] - min(clocks) > s  # refused only when it would exceed the bound
                continue
            assert clocks[r] - min(clocks) <= s
            pulled[r], reads = True, reads + 1
        else:
            shard.push(PushStamp(r, 1, shard.members[r].clock), shard.version, plan, wire(torch.ones(3)))
            pulled[r] = False
    assert shard.status().max_clock_gap <= s
    # liveness: the slowest worker can always read
    slowest = min(range(n), key=lambda r: shard.members[r].clock)
    shard.pull(slowest, 1, 0, plan.digest, timeout=0.0)


# ---------------------------------------------------------------- EASGD (Zhang, Choromanska, LeCun 2015)


def reference_async_easgd(center: torch.Tensor, xs: list[torch.Tensor], alpha: float, order: list[int]):
    """Algorithm 1 as written: for each exchange, d = alpha (x_i - center); x_i -= d; center += d."""
    center, xs = center.clone(), [x.clone() for x in xs]
    for i in order:
        d = alpha * (xs[i] - center)
        xs[i] = xs[i] - d
        center = center + d
    return center, xs


@pytest.mark.parametrize("workers", [1, 2])
def test_async_easgd_matches_algorithm_1(workers: int) -> None:
    g = torch.Generator().manual_seed(workers)
    center0 = torch.randn(5, generator=g)
    xs0 = [torch.randn(5, generator=g) for _ in range(workers)]
    alpha = 0.9 / workers
    order = [0, 1, 1, 0, 1, 0, 0] if workers == 2 else [0, 0, 0, 0]
    ref_center, ref_xs = reference_async_easgd(center0, xs0, alpha, order)
    center, xs = [center0.clone()], [x.clone() for x in xs0]
    for i in order:
        d = easgd.exchange(center, [xs[i]], alpha)
        xs[i] -= d[0]
    assert torch.equal(center[0], ref_center)
    assert all(torch.equal(a, b) for a, b in zip(xs, ref_xs, strict=True))


@pytest.mark.parametrize("workers", [1, 2])
def test_sync_easgd_matches_equations_5_and_6(workers: int) -> None:
    g = torch.Generator().manual_seed(10 + workers)
    center0 = torch.randn(5, generator=g)
    xs = {r: [torch.randn(5, generator=g)] for r in range(workers)}
    alpha = 0.9 / workers
    ref_center = center0 + alpha * sum((xs[r][0] - center0 for r in range(workers)), torch.zeros(5))
    center = [center0.clone()]
    ds = easgd.exchange_round(center, xs, alpha)
    assert torch.allclose(center[0], ref_center, atol=0, rtol=1e-6)
    for r in range(workers):
        assert torch.equal(ds[r][0], alpha * (xs[r][0] - center0))


def test_an_exchange_that_overflows_changes_nothing() -> None:
    center = [torch.full((3,), -3e38), torch.ones(2)]
    before = [c.clone() for c in center]
    with pytest.raises(NonFiniteUpdateError, match="center is unchanged"):
        easgd.exchange(center, [torch.full((3,), 3e38), torch.ones(2)], 0.5)  # x - center overflows
    with pytest.raises(NonFiniteUpdateError):
        xs = {0: [torch.zeros(3), torch.ones(2)], 1: [torch.full((3,), 3e38), torch.ones(2)]}
        easgd.exchange_round(center, xs, 1)
    assert all(torch.equal(a, b) for a, b in zip(center, before, strict=True))


def test_shard_exchange_is_algorithm_1_and_idempotent() -> None:
    from ps_common import frames

    shard, plan, wire = shard_for("easgd", 2, moving_rate=0.5)
    x = torch.tensor([2.0, 4.0, -2.0])
    version, out = shard.exchange(PushStamp(0, 1, 0), plan.digest, wire(x), timeout=1.0, encode=encode_exchange)
    d = frames.view(frames.read(out[0]).partitions[0]).clone()
    assert version == 1 and torch.equal(d, 0.5 * x)
    again = shard.exchange(PushStamp(0, 1, 0), plan.digest, wire(x), timeout=1.0, encode=encode_exchange)
    assert again[0] == 1 and again[1] == out
    assert torch.equal(shard.store.tensors[0], 0.5 * x)  # center moved once


# ---------------------------------------------------------------- sync quorum, settings, live config


def test_quorum_closes_on_the_first_k_pushes() -> None:
    rounds = SyncRounds()
    rounds.add(2, 0, [torch.tensor([3.0])])
    assert rounds.close_if_complete([0, 1, 2], quorum=2) is None
    rounds.add(0, 0, [torch.tensor([1.0])])
    out = rounds.close_if_complete([0, 1, 2], quorum=2)
    assert out is not None and torch.equal(out[0], torch.tensor([2.0])) and rounds.round == 1


def test_late_push_under_quorum_is_dropped_and_counted() -> None:
    shard, plan, wire = shard_for("sync", 2, sync_quorum=1)
    shard.push(PushStamp(0, 1, 0), 0, plan, wire(torch.ones(3)))
    assert shard.version == 1
    late = shard.push(PushStamp(1, 1, 0), 0, plan, wire(torch.ones(3)))
    assert late.dropped and shard.version == 1 and shard.status().rejected_pushes == {"late": 1}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sync_quorum": 3}, "--sync-quorum must be in 0..2"),
        ({"max_staleness": -2}, "--max-staleness"),
        ({"staleness_lr": "sqrt"}, "--staleness-lr"),
        ({"staleness": -1}, "--staleness"),
        ({"moving_rate": 1.5}, "--moving-rate must be in"),
        ({"communication_period": 0}, "--communication-period"),
        ({"round_timeout": -1.0}, "--round-timeout"),
    ],
)
def test_mode_settings_are_validated(kwargs, message) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        ModeSettings("sync", num_workers=2, **kwargs)


def test_default_moving_rate_is_09_over_n() -> None:
    assert ModeSettings("easgd", num_workers=4).moving_rate == pytest.approx(0.225)


def test_update_config_changes_lr_and_mode_at_the_next_round() -> None:
    shard, plan, wire = shard_for("sync", 2)
    shard.push(PushStamp(0, 1, 0), 0, plan, wire(torch.ones(3)))  # round 0 open
    shard.update_config(mode="async", learning_rate=0.5, sync_quorum=0)  # scheduled at version 1
    status = shard.status()
    assert status.learning_rate == 0.1 and status.mode == "sync" and status.pending_mode == "async"
    assert [(c.version, c.update.learning_rate) for c in status.membership.config_changes] == [(1, 0.5)]
    shard.push(PushStamp(1, 1, 0), 0, plan, wire(torch.ones(3)))  # closes round 0 with lr 0.1
    assert shard.version == 1 and shard.mode == "async" and not shard.status().pending_mode
    assert shard.learning_rate() == 0.5 and [c.version for c in shard.status().applied_changes] == [1]
    assert torch.allclose(shard.store.tensors[0], torch.full((3,), -0.1))
    result = shard.push(PushStamp(0, 1, 1), 1, plan, wire(torch.ones(3)))  # async: applied at once
    assert result.mode == "async" and shard.version == 2


def test_bad_updates_change_nothing() -> None:
    shard, plan, wire = shard_for("sync", 2)
    before = shard.status()
    for call in (
        lambda: shard.update_config(mode="easgd"),
        lambda: shard.update_config(staleness=-3),
        lambda: shard.update_config(learning_rate=float("nan")),
    ):
        with pytest.raises(InvalidRequestError):
            call()
    after = shard.status()
    assert (after.settings, after.learning_rate, after.pending_mode) == (before.settings, before.learning_rate, "")
