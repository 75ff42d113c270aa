"""``ps-admin``'s views and requests without a network: settings text, columns, frames, --json, set flags."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from ps_admin.cli import admin_parser, update_request
from ps_admin.client import ShardResult, _Watchdog, reconnect_delays
from ps_admin.view import render_status, render_top, settings_lines, settings_text, staleness_cell, status_json
from ps_proto.v1 import ps_pb2


def config(**kw: object) -> ps_pb2.ClusterConfig:
    base: dict[str, object] = dict(
        mode=ps_pb2.MODE_SYNC,
        num_workers=4,
        learning_rate=0.05,
        max_staleness=-1,
        moving_rate=0.225,
        communication_period=10,
    )
    return ps_pb2.ClusterConfig(**(base | kw))


@pytest.mark.parametrize(
    "cfg, pending, text",
    [
        (config(), ps_pb2.MODE_UNSPECIFIED, "lr 0.05, sync quorum all, round timeout off"),
        (config(sync_quorum=3, round_timeout_seconds=30), ps_pb2.MODE_UNSPECIFIED,
         "lr 0.05, sync quorum 3 of 4, round timeout 30s"),
        (config(mode=ps_pb2.MODE_ASYNC, max_staleness=8, staleness_lr="inverse"), ps_pb2.MODE_UNSPECIFIED,
         "lr 0.05, async max staleness 8, staleness lr inverse"),
        (config(mode=ps_pb2.MODE_SSP, staleness=2), ps_pb2.MODE_UNSPECIFIED, "lr 0.05, ssp staleness 2 clocks"),
        (config(mode=ps_pb2.MODE_EASGD, easgd_sync=True), ps_pb2.MODE_UNSPECIFIED,
         "lr 0.05, easgd moving rate 0.225, period 10 (rounds)"),
    ],
)  # fmt: skip
def test_settings_text_names_the_parameters_of_the_mode_in_force(cfg, pending, text) -> None:
    assert settings_text(cfg) == text


def test_a_pending_mode_gets_a_line_with_its_parameters() -> None:
    lines = settings_lines(
        [("0/2", config(staleness=1), ps_pb2.MODE_SSP), ("1/2", config(staleness=1), ps_pb2.MODE_SSP)]
    )
    assert lines == [
        "settings: lr 0.05, sync quorum all, round timeout off",
        "pending: ssp at the next round boundary (staleness 1 clock)",
    ]


def shard(k: int, **kw: object) -> ShardResult:
    status = ps_pb2.ShardStatus(
        shard_index=k,
        num_shards=2,
        config=config(mode=ps_pb2.MODE_ASYNC),
        initialized=True,
        version=120,
        plan_digest="ab" * 32,
        workers=[
            ps_pb2.WorkerStatus(rank=r, incarnation=1, clock=60, state=ps_pb2.WORKER_STATE_LIVE, pushes=60)
            for r in range(4)
        ],
        pending_mode=ps_pb2.MODE_SSP,
        staleness=ps_pb2.StalenessSummary(count=120, p50=1, p90=3, p99=4, max=5),
        rejected_pushes={"stale": 7, "late": 0},
        **kw,
    )
    return ShardResult(k, f"127.0.0.1:5005{k + 1}", status)


def test_status_shows_settings_staleness_and_refused_pushes() -> None:
    lines = render_status([shard(0), shard(1)])
    assert lines[1:3] == [
        "settings: lr 0.05, async max staleness none, staleness lr constant",
        "pending: ssp at the next round boundary (staleness 0 clocks)",
    ]
    header = lines[4].split()
    assert header[7:9] == ["STALENESS", "REFUSED"]
    assert lines[5].split()[7:9] == ["1/3/5", "stale:7"]


def test_shards_that_disagree_get_a_settings_line_each() -> None:
    other = shard(1, round_age_seconds=4.5, round_waiting_for=[3])
    other.status.config.learning_rate = 0.1
    lines = render_status([shard(0), other])
    assert lines[1:5] == [
        "settings 0/2: lr 0.05, async max staleness none, staleness lr constant",
        "pending 0/2: ssp at the next round boundary (staleness 0 clocks)",
        "settings 1/2: lr 0.1, async max staleness none, staleness lr constant",
        "pending 1/2: ssp at the next round boundary (staleness 0 clocks)",
    ]
    assert lines[5] == "sync round open 4.5s, waiting for rank 3; if it is gone: ps-admin evict 3"
    rank3 = [line for line in lines if line.split()[:2] == ["3", "live"]]
    assert rank3 and "missing 4.5s" in rank3[0]


def test_top_frame_keeps_the_settings_in_80x24() -> None:
    results = [shard(k) for k in range(2)]
    results.append(ShardResult(2, "ps-2:50051", code=grpc.StatusCode.UNAVAILABLE, details="connection refused"))
    lines = render_top(results, 80, 24, 2.0, time.time())
    assert len(lines) <= 23 and all(len(line) <= 80 for line in lines)
    assert lines[2] == "settings: lr 0.05, async max staleness none, staleness lr constant"
    assert lines[3] == "pending: ssp at the next round boundary (staleness 0 clocks)"
    header = next(line for line in lines if line.startswith("SHARD"))
    assert "STALENESS" in header and "REFUSED" in header and "VERSION" in header


def test_status_json_spells_out_the_settings() -> None:
    report = status_json([shard(0)])
    s = report["shards"][0]
    assert s["mode"] == "async" and s["pending_mode"] == "ssp" and s["learning_rate"] == 0.05
    assert s["mode_parameters"] == {"max_staleness": -1, "staleness_lr": ""}
    assert s["staleness"] == {"count": 120, "p50": 1.0, "p90": 3.0, "max": 5}
    assert s["rejected_pushes"] == {"late": 0, "stale": 7}
    assert s["status"]["pending_mode"] == "MODE_SSP"


def test_set_flags_become_one_update_request() -> None:
    args = admin_parser({}).parse_args(
        ["--servers", "h:1", "set", "--lr", "0.05", "--mode", "ssp", "--staleness", "0", "--staleness-lr", "none"]
    )
    request = update_request(args)
    assert request.learning_rate == 0.05 and request.mode == ps_pb2.MODE_SSP
    assert request.HasField("staleness") and request.staleness == 0  # an explicit 0 is sent
    assert request.HasField("staleness_lr") and request.staleness_lr == ""
    assert not request.HasField("sync_quorum") and not request.HasField("moving_rate")


def test_set_twins_do_not_collide_with_the_servers() -> None:
    args = admin_parser({"PS_LR": "0.5", "PS_MODE": "async", "PS_SET_STALENESS": "3"}).parse_args(
        ["--servers", "h:1", "set"]
    )
    request = update_request(args)
    assert request.staleness == 3
    assert not request.HasField("learning_rate") and request.mode == ps_pb2.MODE_UNSPECIFIED


def test_reconnect_delays_grow_to_the_cap_with_jitter() -> None:
    delays = reconnect_delays(0.2, 5.0, random.Random(0))
    got = [next(delays) for _ in range(10)]
    assert 0.1 <= got[0] <= 0.2 and all(2.5 <= d <= 5.0 for d in got[6:])


class FakeCall:
    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


def test_watchdog_cancels_a_silent_stream_and_on_stop() -> None:
    silent = FakeCall()
    dog = _Watchdog(silent, threading.Event(), patience=0.3)  # type: ignore[arg-type]
    assert silent.cancelled.wait(5) and dog.silent
    stopped, stop = FakeCall(), threading.Event()
    dog = _Watchdog(stopped, stop, patience=60)  # type: ignore[arg-type]
    stop.set()
    assert stopped.cancelled.wait(5) and not dog.silent


def test_lr_before_init_is_a_dash_and_sync_staleness_is_zero() -> None:
    """``settings: lr 0`` before Init read as a learning rate of zero; sync mode,
    where no gradient is ever stale, showed ``-``."""
    assert settings_text(ps_pb2.ClusterConfig(mode=ps_pb2.MODE_SYNC)).startswith("lr -, sync")
    assert staleness_cell(ps_pb2.StalenessSummary(), "sync") == "0"
    assert staleness_cell(ps_pb2.StalenessSummary(), "async") == "-"
    assert staleness_cell(ps_pb2.StalenessSummary(count=3, p50=1, p90=2, max=5), "ssp") == "1/2/5"


def test_the_membership_line_shows_the_epoch_and_changes_not_applied_yet() -> None:
    assert not any(line.startswith("membership:") for line in render_status([shard(0)]))
    record = ps_pb2.MembershipEpoch(
        epoch=7,
        num_workers=3,
        reason="config change at version 12",
        config_changes=[ps_pb2.ConfigChange(version=9, epoch=6), ps_pb2.ConfigChange(version=12, epoch=7)],
    )
    result = shard(0)
    assert result.status is not None
    result.status.membership.CopyFrom(record)
    result.status.applied_changes.append(ps_pb2.ConfigChange(version=9, epoch=6))
    line = next(line for line in render_status([result]) if line.startswith("membership:"))
    assert line == "membership: epoch 7 (config change at version 12), 3 workers; scheduled: a change at version 12"
