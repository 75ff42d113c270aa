"""ps_worker.consistency: one worker-side object per mode, looked up by name (no sockets)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ps_common.errors import StalePushError
from ps_common.modes import MODES, ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_proto.v1 import ps_pb2
from ps_worker.consistency import WORKER_MODES, settings_from_config, worker_mode


def session(**kw):
    base = {"clock": 7, "exchanges": 3, "version": 9, "versions": [9, 10], "pushed": [True, False]}
    return SimpleNamespace(**{**base, **kw})


def test_every_mode_has_its_worker_side() -> None:
    assert sorted(WORKER_MODES) == sorted(MODES)
    assert worker_mode("").name == "async"  # before Join: no waits, the step count
    with pytest.raises(ValueError, match="Unknown mode 'bsp'"):
        worker_mode("bsp")


def test_sync_pushes_the_round_and_pulls_its_result() -> None:
    sync, s = worker_mode("sync"), session()
    # the same round to every shard: the lowest version (shard 1, ahead, refuses it until shard 0 caught up)
    assert [sync.push_clock(s, k) for k in range(2)] == [9, 9]
    assert [sync.pull_floor(s, k) for k in range(2)] == [10, 10]
    assert not sync.counts_staleness and not sync.local_optimizer
    sync.after_init(s)
    assert s.clock == 9  # a rank joining a running job starts at the round


@pytest.mark.parametrize("name", ["async", "ssp"])
def test_async_and_ssp_push_the_clock_and_never_wait_at_the_client(name: str) -> None:
    mode, s = worker_mode(name), session()
    assert [mode.push_clock(s, k) for k in range(2)] == [7, 7] and mode.pull_floor(s, 0) == 0
    assert mode.counts_staleness and mode.progress(s, ModeSettings(name)) == 7 and mode.shard_clock(s) == 7


def test_easgd_counts_exchanges_and_resumes_a_period_per_exchange() -> None:
    easgd, s = worker_mode("easgd"), session()
    assert easgd.local_optimizer and easgd.shard_clock(s) == 3
    assert easgd.progress(s, ModeSettings("easgd", communication_period=4)) == 12
    replies = [ps_pb2.JoinResponse(clock=2), ps_pb2.JoinResponse(clock=5)]
    easgd.adopt_join(s, replies)
    worker_mode("sync").adopt_join(s, replies)
    assert s.exchanges == 5 and s.clock == 5


def test_settings_come_from_the_join_response() -> None:
    config = ps_pb2.ClusterConfig(
        mode=ps_pb2.MODE_EASGD,
        num_workers=4,
        max_staleness=-1,
        moving_rate=0.2,
        communication_period=6,
        easgd_sync=True,
    )
    assert settings_from_config(config) == ModeSettings(
        "easgd", num_workers=4, moving_rate=0.2, communication_period=6, easgd_sync=True
    )
    ssp = settings_from_config(ps_pb2.ClusterConfig(mode=ps_pb2.MODE_SSP, num_workers=2, staleness=3))
    assert ssp.staleness == 3 and ssp.communication_period == 1


def test_sync_steps_and_table_pulls_follow_the_round_other_modes_the_count() -> None:
    sync = worker_mode("sync")
    assert sync.pushes_in_rounds and sync.push_round(session()) == 9
    assert sync.next_step(4, 9) == 9 and sync.table_pull_floor(5) == 5
    assert sync.resize_pending(9, 10) and not sync.resize_pending(10, 10)
    for name in ("async", "ssp", "easgd"):
        mode = worker_mode(name)
        assert not mode.pushes_in_rounds and mode.push_round(session()) is None
        assert mode.next_step(4, 9) == 5 and mode.table_pull_floor(5) == 0
        assert not mode.resize_pending(9, 10)


def test_sync_rejoin_drops_a_gradient_stamped_for_another_round() -> None:
    sync, s = worker_mode("sync"), session(rank=1)
    sync.after_rejoin(s, 0, ps_pb2.JoinResponse(clock=9, version=9), 9, "a:1")  # the same round: repush
    with pytest.raises(StalePushError, match="round 9 cannot be taken"):
        sync.after_rejoin(s, 0, ps_pb2.JoinResponse(clock=8, version=8), 9, "a:1")
    with pytest.raises(StalePushError, match="rejoined and counts from round 12"):
        sync.after_rejoin(s, 1, ps_pb2.JoinResponse(clock=12, version=10), None, "a:2")
    assert s.versions[1] == 12  # the pull waits for the round the rank counts from
    worker_mode("async").after_rejoin(s, 0, ps_pb2.JoinResponse(clock=12, version=10), 3, "a:1")  # no rounds


def test_async_and_ssp_say_at_start_that_each_push_is_its_own_step_unlike_ddp() -> None:
    """Three async ranks at DDP's lr 0.1 and momentum 0.9 diverged in some runs (digits, accuracy
    0.10-0.83): rank 0 warns with the lr that DDP's would be divided by; sync does not warn."""
    sgd = OptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.9})
    three = ModeSettings(mode="async", num_workers=3)
    said = worker_mode("async").unlike_ddp(sgd, three)
    assert said is not None and "lr 0.1 (momentum 0.9)" in said and "divided by 3" in said
    assert "--staleness-lr inverse" in said
    ssp = worker_mode("ssp").unlike_ddp(OptimizerSpec("adam", {"lr": 0.001}), ModeSettings(mode="ssp", num_workers=2))
    assert ssp is not None and "lr 0.001;" in ssp and "divided by 2" in ssp and "staleness-lr" not in ssp
    assert worker_mode("async").unlike_ddp(sgd, ModeSettings(mode="async", num_workers=1)) is None
    inverse = ModeSettings(mode="async", num_workers=3, staleness_lr="inverse")
    assert worker_mode("async").unlike_ddp(sgd, inverse) is None  # the shards scale it already
    assert worker_mode("sync").unlike_ddp(sgd, ModeSettings(mode="sync", num_workers=3)) is None
