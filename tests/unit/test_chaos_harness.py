"""The pure checks of the chaos soak (``tests/chaos/harness.py``) on synthetic logs: each holds on a
healthy log and fails on a log with the fault it is meant to catch."""

from __future__ import annotations

from tests.chaos.harness import (
    Hold,
    Incarnation,
    check_accuracy,
    check_exits,
    check_no_hang,
    check_params_identical,
    check_push_accounting,
    longest_hang,
    merge,
    push_counts,
)


def inc(rank: int, n: int, start: int, last: int, *, killed: bool = False, **done: object) -> Incarnation:
    """Incarnation ``n`` of ``rank`` that printed every step start+1..last (and a summary unless killed)."""
    i = Incarnation(rank, n, start=start, steps=list(range(start + 1, last + 1)), killed=killed)
    i.step_times = [float(s) for s in i.steps]
    if not killed:
        i.returncode = 0
        i.done = {"params_sha256": "aa", "accuracy": 0.97, "version": last, "refused_pushes": 0, **done}
    return i


# ----------------------------------------------------------------------------- invariant 1: no hang
def test_merge_and_longest_hang_subtract_held_time() -> None:
    assert merge([(5, 7), (1, 2), (6, 9)]) == [(1, 2), (5, 9)]
    holds = [Hold("shard 0 down", 10.0, 18.0)]
    gap, at, raw = longest_hang([0, 1, 2, 20, 21], holds)
    assert (gap, at, raw) == (10.0, 2.0, 18.0)  # 18 s raw, 8 of them held by the test


def test_no_hang_holds_when_gaps_are_explained_and_fails_on_a_wedge() -> None:
    steps = [0.0, 0.5, 1.0, 3.5, 4.0, 14.0, 14.5]  # 10 s gap, 9 of them a shard kept down
    ok, gap = check_no_hang(steps, [Hold("shard 1 down", 4.5, 13.5)], bound=5.0)
    assert ok.ok and gap == 2.5  # the 1.0 -> 3.5 stretch; the 10 s one is 1 s once the hold is out
    wedged, gap = check_no_hang(steps + [60.0], [Hold("shard 1 down", 4.5, 13.5)], bound=5.0)
    assert not wedged.ok and gap == 45.5 and "45.5 s" in wedged.detail


def test_a_job_that_never_finishes_is_a_hang_to_the_end() -> None:
    steps = [0.0, 1.0, 2.0]  # then nothing: the harness gave up waiting at t=50
    assert check_no_hang(steps, [], bound=10.0)[0].ok
    wedged, gap = check_no_hang(steps, [], bound=10.0, end=50.0)
    assert not wedged.ok and gap == 48.0


def test_a_worker_fault_is_not_an_excuse() -> None:
    # a killed worker: the others must go on after the lease; nothing is subtracted for it
    finding, gap = check_no_hang([0.0, 1.0, 13.0], [], bound=10.0)
    assert not finding.ok and gap == 12.0


# ----------------------------------------------------------------------------- invariant 2: same params
def test_identical_parameters() -> None:
    finals = [inc(0, 1, 0, 100), inc(1, 1, 0, 100), inc(2, 1, 0, 100)]
    assert check_params_identical(finals).ok
    finals[2].done["params_sha256"] = "bb"  # type: ignore[index]
    assert not check_params_identical(finals).ok
    finals[2].done = None
    failed = check_params_identical(finals)
    assert not failed.ok and "[2]" in failed.detail


# ----------------------------------------------------------------------------- invariant 3: exactly once
def healthy_job() -> list[Incarnation]:
    """Rank 0 killed after printing step 40, restarted at 41; ranks 1 and 2 ran 0..100 uninterrupted."""
    return [
        inc(0, 1, 0, 40, killed=True),
        inc(0, 2, 41, 100),
        inc(1, 1, 0, 100),
        inc(2, 1, 0, 100),
    ]


def test_push_accounting_holds_for_a_consistent_log() -> None:
    job = healthy_job()
    # rank 0: 40 acknowledged + 59 = 99, plus at most the one push in flight when it was killed
    for rank0 in (99, 100):
        finding = check_push_accounting(job, [[rank0, 100, 100], [rank0, 100, 100]])
        assert finding.ok, finding.detail
    counts = push_counts(job, [[99, 100, 100], [100, 100, 100]])
    assert [(c.low, c.high) for c in counts if c.rank == 0] == [(99, 100), (99, 100)]


def test_push_accounting_fails_when_a_shard_lost_acknowledged_pushes() -> None:
    # shard 1 resumed from a checkpoint 3 rounds older than rounds it had answered: 3 pushes of each
    # rank were acknowledged, rolled back, and the later steps filled the rounds again
    finding = check_push_accounting(healthy_job(), [[100, 100, 100], [96, 97, 97]])
    assert not finding.ok
    assert "shard 1 rank 1: applied 97, acknowledged bounds [100, 100] -> LOST" in finding.detail


def test_push_accounting_fails_when_a_push_is_applied_twice() -> None:
    # a retried (or replayed after a restart) push of rank 2 applied a second time on shard 0
    finding = check_push_accounting(healthy_job(), [[99, 100, 101], [99, 100, 100]])
    assert not finding.ok and "shard 0 rank 2: applied 101" in finding.detail and "APPLIED TWICE" in finding.detail
    # a killed incarnation's unacknowledged push may be applied at most once, not twice
    assert not check_push_accounting(healthy_job(), [[101, 100, 100], [99, 100, 100]]).ok


def test_refused_pushes_lower_the_floor_and_unprinted_steps_raise_the_ceiling() -> None:
    job = healthy_job()
    job[2].done["refused_pushes"] = 2  # type: ignore[index]
    assert check_push_accounting(job, [[99, 98, 100], [99, 100, 100]]).ok
    killed = Incarnation(0, 1, start=0, steps=[1, 2, 5, 6], killed=True)  # steps 3, 4 never printed
    assert killed.acknowledged() == 4 and killed.max_unprinted() == 1 + 2  # counted: the printed ones
    killed.refused = 1
    assert killed.refused_pushes() == 1


def test_a_process_that_never_trained_counts_nothing() -> None:
    never = Incarnation(1, 5, killed=True)
    assert never.acknowledged() == 0 and never.max_unprinted() == 1


# ----------------------------------------------------------------------------- invariant 4 and exits
def test_accuracy() -> None:
    finals = [inc(0, 1, 0, 100), inc(1, 1, 0, 100, accuracy=0.5)]
    failed = check_accuracy(finals, 0.93)
    assert not failed.ok and "rank 1: 0.5000" in failed.detail
    assert check_accuracy(finals[:1], 0.93).ok


def test_exits() -> None:
    job = healthy_job()
    assert check_exits(job, []).ok
    job[3].returncode = 1
    job[3].done = None
    assert "rank 2 incarnation 1: exit 1" in check_exits(job, []).detail
    assert not check_exits(healthy_job(), ["shard 0 exited on its own with 1"]).ok
