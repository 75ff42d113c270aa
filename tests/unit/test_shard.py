"""The shard state machine without gRPC: joins, init, idempotent pushes, rounds, leases."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ps_common import frames
from ps_common.errors import (
    CheckpointError,
    InvalidRequestError,
    NonFiniteUpdateError,
    NotInitializedError,
    PlanMismatchError,
    PreconditionError,
    ReplayedPushError,
    StalePushError,
    WaitTimeoutError,
)
from ps_common.modes import ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_common.partition import WirePartition
from ps_common.plan import ParameterSpec, make_plan, plan_digest
from ps_server.service.frame_cache import FrameCache
from ps_server.shard.shard import PushStamp, Shard, WorkerState
from tests.helpers.tensors import encode

SPECS = [ParameterSpec("w", (6,), "float32"), ParameterSpec("b", (2,), "float32")]
PLAN = make_plan(SPECS, 1, 16)
SGD = OptimizerSpec("sgd", {"lr": 0.5})


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def wire(fill: float) -> list[WirePartition]:
    return [
        WirePartition(p.key, p.offset, p.length, "float32", encode(torch.full((p.length,), fill)))
        for p in PLAN.owned_by(0)
    ]


def tick(shard: Shard, clock: FakeClock, seconds: int) -> list[int]:
    """Advance the clock ``seconds`` seconds, the lease reaper waking every second; the ranks evicted."""
    evicted = []
    for _ in range(seconds):
        clock.t += 1
        evicted += shard.expire_leases()
    return evicted


def values(shard: Shard) -> torch.Tensor:
    _, out = shard.pull(0, 1, 0, PLAN.digest, timeout=1.0, encode=FrameCache().encoder())
    return torch.cat([frames.view(p).clone() for raw in out for p in frames.read(raw).partitions])


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def shard(clock: FakeClock) -> Shard:
    s = Shard(0, 1, ModeSettings("sync", num_workers=2), lease_timeout=10.0, now=clock)
    s.join(0, 2, 1)
    s.join(1, 2, 1)
    s.init(SPECS, 1, 16, PLAN.digest, SGD, wire(1.0))
    return s


def test_a_push_header_before_init_is_refused_and_changes_nothing(clock: FakeClock) -> None:
    s = Shard(0, 1, ModeSettings("sync", num_workers=2), now=clock)
    s.join(0, 2, 1)
    with pytest.raises(NotInitializedError, match="rank 0 must call Init"):
        s.check_plan(PLAN.digest)  # a push's header, before its partitions are read
    assert s.status().version == 0 and s.status().workers[0].pushes == 0


def test_sync_round_applies_the_rank_ordered_mean(shard: Shard) -> None:
    shard.push(PushStamp(1, 1, 0), 0, PLAN, wire(3.0))
    assert shard.version == 0 and shard.status().round_ranks == (1,)
    shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))
    assert shard.version == 1
    assert torch.equal(values(shard), torch.full((8,), 1.0 - 0.5 * 2.0))


def test_duplicate_push_is_answered_once_and_applied_once(shard: Shard) -> None:
    first = shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))
    again = shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))
    assert again.duplicate and not first.duplicate and again.version == first.version
    assert shard.status().workers[0].pushes == 1
    shard.push(PushStamp(1, 1, 0), 0, PLAN, wire(1.0))
    assert shard.version == 1
    late_dup = shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))
    assert late_dup.duplicate and shard.version == 1


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda s: s.push(PushStamp(2, 1, 0), 0, PLAN, wire(1.0)), InvalidRequestError, "out of range"),
        (lambda s: s.check_plan("f" * 64), PlanMismatchError, "does not match"),
        (lambda s: s.push(PushStamp(0, 1, 0), 0, PLAN, wire(float("nan"))), InvalidRequestError, "NaN"),
        (lambda s: s.push(PushStamp(0, 1, 3), 0, PLAN, wire(1.0)), PreconditionError, "pull version 3"),
        (lambda s: s.push(PushStamp(0, 0, 0), 0, PLAN, wire(1.0)), PreconditionError, "superseded"),
        (lambda s: s.join(0, 3, 1), InvalidRequestError, "num_workers=2"),
        (lambda s: s.init(SPECS[:1], 1, 16, make_plan(SPECS[:1], 1, 16).digest, SGD, []), PlanMismatchError, "match"),
    ],
)
def test_bad_requests_change_nothing(shard: Shard, call, error, message) -> None:
    before = shard.status()
    with pytest.raises(error, match=message):
        call(shard)
    after = shard.status()
    assert (after.version, after.round_ranks, after.workers) == (before.version, before.round_ranks, before.workers)
    assert torch.equal(values(shard), torch.ones(8))


def test_init_is_first_writer_wins(shard: Shard) -> None:
    applied, version, digest = shard.init(SPECS, 1, 16, PLAN.digest, SGD, wire(7.0))
    assert not applied and digest == PLAN.digest
    assert torch.equal(values(shard), torch.ones(8))


def test_a_shard_initialized_at_a_version_takes_that_round_next(clock: FakeClock) -> None:
    """diloco's rank 0 writes a shard that restarted empty theta_global at the ranks' outer round."""
    s = Shard(0, 1, ModeSettings("diloco", num_workers=2), now=clock)
    s.join(0, 2, 1)
    s.join(1, 2, 1)
    assert s.init(SPECS, 1, 16, PLAN.digest, SGD, wire(1.0), version=9) == (True, 9, PLAN.digest)
    s.push(PushStamp(0, 1, 9), 9, PLAN, wire(1.0))
    s.push(PushStamp(1, 1, 9), 9, PLAN, wire(1.0))
    assert s.version == 10 and s.join(0, 2, 1).clock == 10


def test_stale_round_push_is_aborted(shard: Shard) -> None:
    shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))
    shard.push(PushStamp(1, 1, 0), 0, PLAN, wire(1.0))
    with pytest.raises(StalePushError, match="counts from round 2"):
        shard.join(0, 2, 2)  # a restarted rank 0 replays clock 0 under a new incarnation
        shard.push(PushStamp(0, 2, 0), 0, PLAN, wire(2.0))


def test_pull_for_a_round_without_its_push_is_push_lost(shard: Shard) -> None:
    """After a restart from an older checkpoint the acknowledged push is gone: waiting would deadlock."""
    from ps_common.errors import PushLostError

    with pytest.raises(PushLostError, match="push round 0 again"):
        shard.pull(0, 1, 1, PLAN.digest, timeout=1.0)
    shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))
    with pytest.raises(PushLostError):
        shard.pull(0, 1, 3, PLAN.digest, timeout=1.0)  # beyond the open round: also unreachable


def test_a_pull_beyond_the_open_round_waits_for_nothing(shard: Shard) -> None:
    """A reader that is not a counted rank (never joined under that incarnation) asking for a version
    beyond what the open round makes is refused at once (OUT_OF_RANGE), not left waiting forever."""
    from ps_common.errors import VersionAheadError

    for rank, incarnation in ((1, 2**63), (1, 7)):
        with pytest.raises(VersionAheadError, match=rf"version {2**63} .* holds version 0 .* makes 1"):
            shard.pull(rank, incarnation, 2**63, PLAN.digest, timeout=None)
        with pytest.raises(VersionAheadError):
            shard.pull(rank, incarnation, 2, PLAN.digest, timeout=None)
    with pytest.raises(WaitTimeoutError):  # the next version is reachable: it waits
        shard.pull(1, 2**63, 1, PLAN.digest, timeout=0.0)


def test_pull_waits_for_the_round_and_times_out_naming_the_laggard(shard: Shard) -> None:
    shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))
    with pytest.raises(WaitTimeoutError, match=r"ranks \[1\]"):
        shard.pull(0, 1, 1, PLAN.digest, timeout=0.0)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(shard.pull(0, 1, 1, PLAN.digest, timeout=10.0)[0]))
    waiter.start()
    shard.push(PushStamp(1, 1, 0), 0, PLAN, wire(1.0))
    waiter.join(timeout=10.0)
    assert got == [1]


def test_lapsed_lease_evicts_and_the_round_goes_on(shard: Shard, clock: FakeClock) -> None:
    shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))
    assert tick(shard, clock, 5) == []
    shard.heartbeat(0, 1)
    assert tick(shard, clock, 5) == []
    assert tick(shard, clock, 1) == [1]  # rank 1 silent for 11 s > 10 s lease, rank 0 for 6 s
    assert shard.version == 1
    assert [w.state for w in shard.status().workers] == [WorkerState.LIVE, WorkerState.EVICTED]
    with pytest.raises(PreconditionError, match="call Join again"):
        shard.push(PushStamp(1, 1, 0), 0, PLAN, wire(1.0))
    shard.join(1, 2, 2)  # comes back with a higher incarnation: counted again from the next round
    assert shard.status().workers[1].clock == 2
    shard.push(PushStamp(0, 1, 1), 1, PLAN, wire(1.0))  # round 1 goes on without it
    assert shard.version == 2
    with pytest.raises(StalePushError, match="counts from round 2"):
        shard.push(PushStamp(1, 2, 1), 1, PLAN, wire(1.0))
    shard.push(PushStamp(0, 1, 2), 2, PLAN, wire(1.0))
    assert shard.version == 2
    shard.push(PushStamp(1, 2, 2), 2, PLAN, wire(1.0))
    assert shard.version == 3


def test_close_wakes_waiters(shard: Shard) -> None:
    from ps_common.errors import ShuttingDownError

    errors: list[Exception] = []

    shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))  # round 0 waits for rank 1

    def wait() -> None:
        try:
            shard.pull(0, 1, 1, PLAN.digest, timeout=10.0)
        except ShuttingDownError as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    shard.close()
    t.join(timeout=10.0)
    assert len(errors) == 1


def test_a_closed_shard_takes_no_push_even_one_that_completes_a_round(shard: Shard) -> None:
    """Once closing, the final checkpoint may be written: a push that would complete the open round
    is refused (UNAVAILABLE, retried against the restart) and applies nothing, rather than being
    answered and then lost with the restart."""
    from ps_common.errors import ShuttingDownError

    shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))  # round 0 waits for rank 1
    before = values(shard).clone()
    shard.close()
    with pytest.raises(ShuttingDownError, match="shutting down"):
        shard.push(PushStamp(1, 1, 0), 0, PLAN, wire(3.0))
    assert shard.version == 0 and torch.equal(values(shard), before)
    assert 1 not in shard.rounds.pending  # not held either


def test_the_shards_own_pause_evicts_nobody(shard: Shard, clock: FakeClock) -> None:
    assert tick(shard, clock, 5) == []
    clock.t += 30  # SIGSTOP, CPU starvation: the reaper wakes 30 s late, having heard nobody
    assert shard.expire_leases() == []
    assert [w.state for w in shard.status().workers] == [WorkerState.LIVE] * 2
    assert tick(shard, clock, 5) == []
    shard.heartbeat(0, 1)
    assert tick(shard, clock, 5) == []  # a lease from the resume: rank 1 has been silent 10 s awake
    assert tick(shard, clock, 1) == [1]  # and now 11 s: its own silence evicts it


def test_a_round_that_would_make_parameters_non_finite_is_refused_as_a_whole(shard: Shard) -> None:
    shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(3e38))
    with pytest.raises(NonFiniteUpdateError, match="round 0 \\(ranks \\[0, 1\\]\\)"):
        shard.push(PushStamp(1, 1, 0), 0, PLAN, wire(3e38))  # the sum overflows float32
    with pytest.raises(NonFiniteUpdateError, match="unchanged"):  # the other rank learns it from its pull
        shard.pull(0, 1, 1, PLAN.digest, timeout=1.0)
    assert shard.version == 0 and shard.status().round_ranks == ()
    assert shard.status().rejected_pushes == {"non_finite_update": 2}
    assert torch.equal(values(shard), torch.ones(8))
    shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))  # the same stamps push round 0 again
    assert not shard.push(PushStamp(1, 1, 0), 0, PLAN, wire(1.0)).duplicate
    assert shard.version == 1 and torch.equal(values(shard), torch.full((8,), 0.5))


def test_a_refused_round_reaches_a_waiting_pull(shard: Shard) -> None:
    shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(3e38))
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            shard.pull(0, 1, 1, PLAN.digest, timeout=10.0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    with pytest.raises(NonFiniteUpdateError):
        shard.push(PushStamp(1, 1, 0), 0, PLAN, wire(3e38))
    waiter.join(10.0)
    assert not waiter.is_alive() and len(errors) == 1 and isinstance(errors[0], NonFiniteUpdateError)


def async_shard(clock: FakeClock) -> Shard:
    s = Shard(0, 1, ModeSettings("async", num_workers=1), now=clock)
    s.join(0, 1, 1)
    s.init(SPECS, 1, 16, PLAN.digest, SGD, wire(1.0))
    return s


def test_a_replay_beyond_the_window_is_refused_and_the_mark_survives_a_checkpoint(clock: FakeClock) -> None:
    s = async_shard(clock)
    for c in range(70):
        s.push(PushStamp(0, 1, c), c, PLAN, wire(0.001))
    assert s.push(PushStamp(0, 1, 69), 0, PLAN, wire(0.001)).duplicate
    with pytest.raises(ReplayedPushError, match="clock 3 is a replay"):
        s.push(PushStamp(0, 1, 3), 0, PLAN, wire(0.001))
    assert s.version == 70 and s.status().rejected_pushes == {"replayed": 1}
    saved = s.export_state()

    restarted = Shard(0, 1, ModeSettings("async", num_workers=1), now=clock)
    restarted.restore(saved)
    with pytest.raises(ReplayedPushError):
        restarted.push(PushStamp(0, 1, 3), 0, PLAN, wire(0.001))
    assert restarted.push(PushStamp(0, 1, 69), 0, PLAN, wire(0.001)).duplicate
    restarted.push(PushStamp(0, 1, 70), 70, PLAN, wire(0.001))
    assert restarted.version == 71
    restarted.join(0, 1, 2)  # a new incarnation starts its clocks over
    restarted.push(PushStamp(0, 2, 0), 71, PLAN, wire(0.001))
    assert restarted.version == 72


def test_a_checkpoint_without_marks_still_loads(clock: FakeClock) -> None:
    s = async_shard(clock)
    s.push(PushStamp(0, 1, 0), 0, PLAN, wire(0.001))
    saved = s.export_state()
    for member in saved["members"]:  # as written before high-water marks existed
        del member["high_water"], member["history"]
    restarted = Shard(0, 1, ModeSettings("async", num_workers=1), now=clock)
    restarted.restore(saved)
    assert restarted.version == 1 and restarted.members[0].high_water == -1
    restarted.push(PushStamp(0, 1, 1), 1, PLAN, wire(0.001))
    assert restarted.version == 2


def test_a_checkpoint_of_the_release_before_the_packing_version_loads_and_a_forged_digest_does_not(
    clock: FakeClock,
) -> None:
    s = async_shard(clock)
    s.push(PushStamp(0, 1, 0), 0, PLAN, wire(0.001))
    saved = s.export_state()
    saved["plan"]["digest"] = plan_digest(
        SPECS, 1, 16, packing=0, cut=1
    )  # as written before the digest covered packing
    restarted = Shard(0, 1, ModeSettings("async", num_workers=1), now=clock)
    restarted.restore(saved)
    assert restarted.version == 1 and restarted.plan is not None and restarted.plan.digest == PLAN.digest
    saved["plan"]["digest"] = plan_digest(SPECS, 1, 16, packing=2)  # another packing rule: refused
    with pytest.raises(CheckpointError, match="another release"):
        Shard(0, 1, ModeSettings("async", num_workers=1), now=clock).restore(saved)


def test_a_learning_rate_beyond_the_dtype_is_refused(shard: Shard) -> None:
    with pytest.raises(InvalidRequestError, match="float32"):
        shard.update_config(learning_rate=1e308)
    assert shard.learning_rate() == 0.5


def test_an_async_push_pull_with_durable_acks_reads_after_its_push_is_durable() -> None:
    """With ``--durable-acks`` a PushPull waits until its push's version is checkpointed and only
    then reads: the answer carries the pushes applied during that wait (async SGD with a checkpoint
    per version converges on them; a read before the wait hands every rank weights a wait older)."""
    s = Shard(0, 1, ModeSettings("async", num_workers=2))
    s.durable_acks = True
    for rank in (0, 1):
        s.join(rank, 2, 1)
    s.init(SPECS, 1, 16, PLAN.digest, SGD, wire(1.0))
    answers: dict[int, int] = {}

    def push_pull(rank: int) -> None:
        encode = FrameCache().encoder()
        _, answers[rank], _, _ = s.push_pull(PushStamp(rank, 1, 0), 0, PLAN, wire(1.0), 10.0, encode)

    def until(version: int) -> None:
        deadline = time.monotonic() + 10.0
        while s.version < version:
            assert time.monotonic() < deadline, f"version {version} not reached"
            time.sleep(0.005)

    threads = [threading.Thread(target=push_pull, args=(rank,), daemon=True) for rank in (0, 1)]
    threads[0].start()
    until(1)  # rank 0's push applied; its answer waits for version 1 on disk
    threads[1].start()
    until(2)
    s.checkpointed(2)
    for t in threads:
        t.join(timeout=10.0)
        assert not t.is_alive()
    assert answers == {0: 2, 1: 2}
