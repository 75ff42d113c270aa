"""The join deadline and the members a resumed shard awaits: pure bookkeeping on an injected clock."""

from __future__ import annotations

import pytest

from ps_server.config import config_from_args
from ps_server.membership.ranks import JoinDeadline, Membership, WorkerState


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_deadline_counts_from_the_first_join_only() -> None:
    clock = Clock()
    m = Membership(3, lease_timeout=10.0, now=clock, join_timeout=300.0)
    assert m.joins.due() is None and m.joins.missing(m.members) == []
    clock.t += 1000  # shards up long before any worker: no deadline yet
    m.joins.start()
    m.members[0].state = WorkerState.LIVE
    clock.t += 200
    m.joins.start()  # a later join does not move it
    assert m.joins.due() == 1100.0 + 300.0
    clock.t += 99.9
    assert m.joins.missing(m.members) == []
    clock.t += 0.1
    assert m.joins.missing(m.members) == [1, 2]
    m.members[1].state = WorkerState.LIVE
    m.members[2].state = WorkerState.EVICTED  # an operator went on without it
    assert m.joins.missing(m.members) == []


def test_zero_waits_forever() -> None:
    clock = Clock()
    joins = JoinDeadline(0.0, clock)
    joins.start()
    clock.t += 1e9
    assert joins.due() is None and joins.missing(Membership(2, 10.0, clock).members) == []


def test_message_names_every_missing_rank_and_the_remedies() -> None:
    text = JoinDeadline(300.0, Clock()).describe([1, 3], shard_index=2)
    assert text.startswith("Ranks [1, 3] never joined shard 2 within --join-timeout 300 s")
    assert "ps-admin evict 1" in text and "--join-timeout" in text


def test_restored_ranks_that_left_are_awaited_again() -> None:
    clock = Clock()
    saved = Membership(4, 10.0, clock)
    states = [WorkerState.LEFT, WorkerState.LIVE, WorkerState.EVICTED, WorkerState.PENDING]
    for member, state in zip(saved.members, states, strict=True):
        member.state, member.clock, member.incarnation = state, 20, 7
        member.counted = state is not WorkerState.EVICTED  # shard 0's decision
    resumed = Membership(4, 10.0, clock)
    resumed.restore(saved.export())
    assert [m.state for m in resumed.members] == [
        WorkerState.PENDING,  # finished: a job run again goes on with it, not without it
        WorkerState.LIVE,  # with a fresh lease to come back in
        WorkerState.EVICTED,
        WorkerState.PENDING,
    ]
    assert resumed.expected() == [0, 1, 3] and [m.clock for m in resumed.members] == [20] * 4
    assert resumed.members[0].last_seen is None and resumed.members[1].last_seen == clock.t


def test_join_timeout_flag_twin_default_and_range(capsys) -> None:
    base = ["--shard-index", "0", "--num-shards", "1", "--num-workers", "2"]
    assert config_from_args(base, environ={})[0].join_timeout == 300.0
    assert config_from_args(base, environ={"PS_JOIN_TIMEOUT": "0"})[0].join_timeout == 0.0
    assert config_from_args([*base, "--join-timeout", "2.5"], environ={"PS_JOIN_TIMEOUT": "9"})[0].join_timeout == 2.5
    for bad in ("-1", "nan", "1e9"):
        with pytest.raises(SystemExit):
            config_from_args([*base, "--join-timeout", bad], environ={})
        assert "--join-timeout must be in 0..86400 seconds" in capsys.readouterr().err
