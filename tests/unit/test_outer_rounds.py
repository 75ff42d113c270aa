"""ps_common.outer_rounds: diloco's outer rounds in inner steps, counted across live changes of H and F."""

from __future__ import annotations

from types import SimpleNamespace

from ps_common.modes import ModeSettings
from ps_common.outer_rounds import in_force, inner_step, round_steps
from ps_proto.v1 import ps_pb2
from ps_worker.consistency import worker_mode

DILOCO = ModeSettings("diloco", communication_period=10)


def change(version: int, inner: int | None = None, **update: int) -> ps_pb2.ConfigChange:
    out = ps_pb2.ConfigChange(version=version, update=ps_pb2.UpdateConfigRequest(**update))
    if inner is not None:
        out.inner_step = inner
    return out


def test_without_changes_a_round_is_h_over_f_inner_steps() -> None:
    assert inner_step(DILOCO, [], 7) == 70
    streaming = ModeSettings("diloco", communication_period=10, fragments=2)
    assert round_steps(streaming, [], 3) == 5 and inner_step(streaming, [], 3) == 15


def test_a_live_change_of_h_counts_the_rounds_before_it_at_the_old_h() -> None:
    """The issue's case: H 10 -> 4 at version 5. A rank restarted at version 11 resumes at inner step
    50 + 6 * 4 = 74 — whether it reads the settings of before the change or today's (H 4)."""
    changes = [change(5, inner=50, communication_period=4)]
    today = ModeSettings("diloco", communication_period=4)
    for settings in (DILOCO, today):
        assert inner_step(settings, changes, 11) == 74
        assert inner_step(settings, changes, 5) == 50
        assert in_force(settings, changes, 4, "communication_period") in (10, 4)  # before it: the settings'
        assert in_force(settings, changes, 5, "communication_period") == 4
    assert inner_step(DILOCO, changes, 3) == 30  # a round before the change


def test_each_stretch_is_counted_at_its_own_h_and_f() -> None:
    changes = [
        change(2, inner=20, communication_period=4),  # rounds 2.. take 4 steps
        change(4, inner=28, learning_rate=0.1),  # another parameter: the count goes on
        change(6, inner=36, fragments=2),  # 4 // 2 = 2 steps a round
    ]
    assert [inner_step(DILOCO, changes, v) for v in (1, 2, 3, 4, 6, 9)] == [10, 20, 24, 28, 36, 42]


def test_changes_without_a_stamp_are_counted_round_by_round() -> None:
    """Changes scheduled by a shard that did not stamp them: each stretch at the values in force."""
    changes = [change(2, communication_period=4), change(5, fragments=2)]
    assert inner_step(DILOCO, changes, 7) == 2 * 10 + 3 * 4 + 2 * 2


def test_a_restarted_diloco_rank_resumes_at_the_clusters_inner_step() -> None:
    record = ps_pb2.MembershipEpoch(config_changes=[change(5, inner=50, communication_period=4)])
    session = SimpleNamespace(version=11, membership=record)
    assert worker_mode("diloco").progress(session, ModeSettings("diloco", communication_period=4)) == 74
    assert worker_mode("diloco").round_start(11, DILOCO, record.config_changes) == 74
    assert worker_mode("sync").round_start(11, ModeSettings(), record.config_changes) == 11
