"""Membership epochs (ps_server.membership.epochs) on two in-process shards: shard 0 decides, shard 1 follows
the records a worker would relay; rounds, configuration changes and resizes land at the same
version on both."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ps_common.errors import InvalidRequestError, NotJoinedError, PreconditionError
from ps_common.modes import ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_common.partition import WirePartition
from ps_common.plan import ParameterSpec, make_plan
from ps_proto.v1 import ps_pb2
from ps_server.membership.epochs import COUNTER_BITS, Epochs
from ps_server.membership.ranks import Membership
from ps_server.shard.shard import PushStamp, Shard, WorkerState
from tests.helpers.tensors import encode
from tests.unit.test_shard import FakeClock

SPECS = [ParameterSpec("w", (4,), "float32"), ParameterSpec("b", (4,), "float32")]
PLAN = make_plan(SPECS, 2, 16)
SGD = OptimizerSpec("sgd", {"lr": 0.5})


def wire(k: int, fill: float) -> list[WirePartition]:
    return [
        WirePartition(p.key, p.offset, p.length, "float32", encode(torch.full((p.length,), fill)))
        for p in PLAN.owned_by(k)
    ]


def cluster(num_workers: int = 3, mode: str = "sync", clock: FakeClock | None = None) -> list[Shard]:
    clock = clock or FakeClock()
    shards = [Shard(k, 2, ModeSettings(mode, num_workers=num_workers), lease_timeout=5.0, now=clock) for k in (0, 1)]
    for k, s in enumerate(shards):
        s.init(SPECS, 2, 16, PLAN.digest, SGD, wire(k, 1.0))
        for r in range(num_workers):
            s.join(r, num_workers, 1)
    return shards


def push_round(shards: list[Shard], ranks: list[int], clock: int) -> None:
    for s in shards:
        for r in ranks:
            s.push(PushStamp(r, 1, clock), clock, PLAN, wire(s.shard_index, 1.0))


def relay(shards: list[Shard]) -> None:
    """What a worker's next request or heartbeat does: hand shard 0's record to shard 1."""
    shards[1].adopt(shards[0].epochs.record)


def test_only_shard_0_evicts_and_shard_1_closes_the_same_round_once_told() -> None:
    clock = FakeClock()
    shards = cluster(clock=clock)
    push_round(shards, [0, 1, 2], 0)
    push_round(shards, [0, 1], 1)  # rank 2 went silent in round 1
    for _ in range(6):  # past the lease, on both shards' clocks, the reapers waking every second
        clock.t += 1.0
        for r in (0, 1):
            shards[0].heartbeat(r, 1)
        assert shards[1].expire_leases() == []  # a follower never decides
        evicted = shards[0].expire_leases()
    assert evicted == [2]
    assert (shards[0].version, shards[1].version) == (2, 1)  # shard 1 still waits for rank 2 ...
    assert shards[1].status().round_waiting_for == (2,)
    relay(shards)  # ... until the record reaches it: the same round closes there
    assert (shards[0].version, shards[1].version) == (2, 2)
    assert shards[1].members[2].state is WorkerState.EVICTED and not shards[1].members[2].counted
    assert shards[1].epochs.epoch == shards[0].epochs.epoch > 0
    with pytest.raises(NotJoinedError):  # its pushes are refused on shard 1 too, until it rejoins
        shards[1].push(PushStamp(2, 1, 2), 2, PLAN, wire(1, 1.0))


def test_a_rejoin_is_decided_by_shard_0_and_followed_by_shard_1() -> None:
    shards = cluster()
    shards[0].evict(2)
    relay(shards)
    with pytest.raises(NotJoinedError, match="join shard 0 first"):
        shards[1].join(2, 3, 2)
    shards[0].join(2, 3, 2)  # a restarted process: shard 0 counts it again (a new epoch)
    assert shards[0].members[2].counted and shards[0].epochs.epoch > shards[1].epochs.epoch
    relay(shards)
    # counted from shard 0's next round, on both shards
    assert shards[1].join(2, 3, 2).clock == 1 and shards[1].members[2].counted
    assert [s.membership.expected(0) for s in shards] == [[0, 1]] * 2
    assert [s.membership.expected(1) for s in shards] == [[0, 1, 2]] * 2


def test_followers_refuse_membership_and_configuration_calls() -> None:
    follower = cluster()[1]
    for call in (
        lambda: follower.evict(0),
        lambda: follower.update_config(learning_rate=0.1),
        lambda: follower.resize(4),
    ):
        with pytest.raises(PreconditionError, match="shard 0 decides"):
            call()
    assert follower.epochs.epoch == 0 and follower.num_workers == 3


def test_a_config_change_applies_at_the_same_version_on_every_shard() -> None:
    shards = cluster(num_workers=2)
    push_round(shards, [0], 0)  # round 0 open
    shards[0].update_config(learning_rate=0.25, mode="async")  # default: the next round, version 1
    relay(shards)
    for s in shards:
        assert [c.version for c in s.epochs.pending()] == [1] and s.learning_rate() == 0.5
        assert s.status().pending_mode == "async"
    push_round(shards, [1], 0)  # closes round 0 (lr 0.5) on both
    for s in shards:
        assert s.version == 1 and s.learning_rate() == 0.25 and s.mode == "async"
        assert [c.version for c in s.status().applied_changes] == [1]
    with pytest.raises(InvalidRequestError, match="too early"):
        shards[0].update_config(learning_rate=0.1, at_version=0)
    shards[0].update_config(learning_rate=0.125, at_version=3)  # explicit
    relay(shards)
    for s in shards:
        s.push(PushStamp(0, 1, 1), 1, PLAN, wire(s.shard_index, 0.0))
        assert s.version == 2 and s.learning_rate() == 0.25
        s.push(PushStamp(0, 1, 2), 2, PLAN, wire(s.shard_index, 0.0))
        assert s.version == 3 and s.learning_rate() == 0.125


def test_a_late_record_applies_a_due_change_on_arrival() -> None:
    shards = cluster(num_workers=1)
    shards[0].update_config(sync_quorum=1, at_version=0)
    push_round(shards, [0], 0)
    relay(shards)  # shard 1 is at version 1 already: applied when it arrives
    assert shards[1].settings.sync_quorum == 1 and [c.version for c in shards[1].epochs.applied] == [1]


def test_a_resize_holds_from_its_round_on_every_shard() -> None:
    shards = cluster(num_workers=2)
    push_round(shards, [0, 1], 0)
    previous, at = shards[0].resize(3)  # ranks live: from the next round
    assert (previous, at) == (2, 2) and shards[0].num_workers == 3
    relay(shards)
    push_round(shards, [0, 1], 1)  # round 1 (before the resize) closes with the two ranks
    assert [s.version for s in shards] == [2, 2]
    push_round(shards, [0, 1], 2)  # round 2 waits for the new rank
    assert [s.status().round_waiting_for for s in shards] == [(2,), (2,)]
    for s in shards:
        assert s.join(2, 2, 1).clock == 2  # it starts at the resize's round
        s.push(PushStamp(2, 1, 2), 2, PLAN, wire(s.shard_index, 1.0))
    assert [s.version for s in shards] == [3, 3] and [s.num_workers for s in shards] == [3, 3]
    # shrink to one: rank 1 and 2 push the rounds before it, none from it
    shards[0].resize(1, at_version=4)
    relay(shards)
    push_round(shards, [0, 1, 2], 3)
    assert [s.version for s in shards] == [4, 4]
    for s in shards:
        with pytest.raises(NotJoinedError, match="resized to num_workers=1"):
            s.push(PushStamp(1, 1, 4), 4, PLAN, wire(s.shard_index, 1.0))
        assert s.pull(1, 1, 4, PLAN.digest, timeout=1.0)[0] == 4  # it still reads its last round's result
    push_round(shards, [0], 4)
    assert [s.version for s in shards] == [5, 5]
    assert [[m.counted for m in s.members] for s in shards] == [[True, False, False]] * 2


def test_resize_refusals_change_nothing() -> None:
    shard = cluster(num_workers=2)[0]
    formed = shard.epochs.epoch  # the cluster's first join: "cluster formed"
    with pytest.raises(InvalidRequestError, match="from 1 to 65536"):
        shard.resize(0)
    with pytest.raises(InvalidRequestError, match="from 1 to 65536"):
        shard.resize(10**9)  # refused before a member is built
    with pytest.raises(InvalidRequestError, match="has passed"):
        shard.version = 5
        shard.resize(3, at_version=4)
    easgd = Shard(0, 1, ModeSettings("easgd", num_workers=2))
    with pytest.raises(PreconditionError, match="easgd"):
        easgd.resize(3)
    assert shard.num_workers == 2 and shard.epochs.epoch == formed


def test_a_restarted_authority_decides_above_any_epoch_before_it() -> None:
    members = Membership(2, 5.0, FakeClock())
    first = Epochs(authority=True, num_workers=2, wall=lambda: 1000.0)
    first.decide(members, 0, "one")
    first.decide(members, 0, "two")
    assert first.epoch == (1000 << COUNTER_BITS) + 1
    again = Epochs(authority=True, num_workers=2, wall=lambda: 1001.0)
    again.restore(first.export())  # from a checkpoint taken then
    assert again.decide(members, 0, "after the restart").epoch == 1001 << COUNTER_BITS
    follower = Epochs(authority=False, num_workers=2)
    assert follower.adopt(first.record, members) and not follower.adopt(first.record, members)
    assert follower.adopt(again.record, members) and follower.for_request(first.epoch) is follower.record
    assert follower.for_request(again.epoch) is None


def test_records_carry_counted_ranks_as_live_or_pending_and_the_rest_as_evicted_or_left() -> None:
    shard = cluster(num_workers=3)[0]
    shard.leave(1, 1)
    shard.evict(2)
    states = [m.state for m in shard.epochs.record.members]
    assert states == [ps_pb2.WORKER_STATE_LIVE, ps_pb2.WORKER_STATE_LEFT, ps_pb2.WORKER_STATE_EVICTED]
    assert "evicted by an operator" in shard.epochs.record.reason


def test_checkpoints_restore_onto_another_worker_count_only_when_the_flag_changed() -> None:
    shards = cluster(num_workers=2)
    push_round(shards, [0, 1], 0)
    shards[0].resize(4, at_version=1)
    state = shards[0].export_state()
    same_flag = Shard(0, 2, ModeSettings("sync", num_workers=2))
    same_flag.restore(state)  # --num-workers as before: the checkpoint's resize stands
    assert same_flag.num_workers == 4 and same_flag.settings.num_workers == 4
    shards[0].resize(1, at_version=1)  # and a shrink: 4 ranks listed, 1 counted
    follower = Shard(1, 2, ModeSettings("sync", num_workers=2))
    follower.restore(shards[0].export_state() | {"plan": state["plan"]})
    assert follower.num_workers == 1 and follower.membership.expected(5) == [0]
    new_flag = Shard(0, 2, ModeSettings("sync", num_workers=3))
    new_flag.restore(state)  # the operator changed --num-workers: shard 0 resizes to it
    assert new_flag.num_workers == 3 and [m.counted for m in new_flag.members] == [True, True, True, False]
    assert "restored onto --num-workers 3" in new_flag.epochs.record.reason
    assert new_flag.epochs.epoch > state_epoch(state)


def state_epoch(state: dict) -> int:
    return ps_pb2.MembershipEpoch.FromString(state["epochs"]["record"]).epoch


def test_a_process_restarted_mid_round_starts_at_the_same_round_on_every_shard() -> None:
    shards = cluster(num_workers=2)
    push_round(shards, [0, 1], 0)
    push_round(shards[1:], [0, 1], 1)  # rank 1's old process pushed round 1 to shard 1 only, then died
    push_round(shards[:1], [0], 1)
    assert [s.version for s in shards] == [1, 2]  # shard 0 waits for rank 1's round 1
    first = shards[0].join(1, 2, 2)  # the new process: shard 0 decides it counts from round 2
    assert first.clock == 2 and shards[0].version == 2  # round 1 went on without it
    assert shards[0].members[1].until == 1  # its old process's pushes count in rounds < 1 only
    relay(shards)
    # shard 1 closed round 1 with rank 1's push, which shard 0 never took: it says so and takes no push
    assert "cannot close round 1" in shards[1].lost_round
    with pytest.raises(PreconditionError, match="cannot close round 1 with the ranks shard 0 closed it with"):
        shards[1].push(PushStamp(0, 1, 2), 2, PLAN, wire(1, 1.0))


def test_a_process_restarted_mid_push_counts_where_shard_0_took_it_on_every_shard() -> None:
    shards = cluster(num_workers=2)
    push_round(shards, [0, 1], 0)
    push_round(shards[:1], [1], 1)  # rank 1's old process pushed round 1 to shard 0 only, then died
    first = shards[0].join(1, 2, 2)  # the new process: shard 0 counts the old one's push of round 1
    assert first.clock == 2 and shards[0].members[1].until == 2
    relay(shards)
    push_round(shards, [0], 1)  # shard 0 closes round 1 with ranks 0 and 1; shard 1 still waits for 1
    assert [s.version for s in shards] == [2, 1]
    assert shards[1].join(1, 2, 2).clock == 2  # the new process cannot push round 1 to shard 1 ...
    assert "cannot close round 1" in shards[1].lost_round  # ... which says so rather than close it without
    assert shards[0].lost_round == ""


def test_a_process_restarted_mid_push_that_joins_a_follower_before_the_record_loses_the_round_there() -> None:
    shards = cluster(num_workers=2)
    push_round(shards, [0, 1], 0)
    push_round(shards[:1], [1], 1)  # rank 1's old process pushed round 1 to shard 0 only, then died
    shards[0].join(1, 2, 2)  # the new process: shard 0 counts the old one's push of round 1
    push_round(shards, [0], 1)
    shards[1].join(1, 2, 2)  # it joins shard 1 before shard 0's record reaches it
    assert shards[1].lost_round == ""
    relay(shards)  # the record: round 1 counts the old process's push, which shard 1 never got
    assert "cannot close round 1" in shards[1].lost_round


def test_a_process_restarted_between_rounds_goes_on_at_the_same_round_on_every_shard() -> None:
    shards = cluster(num_workers=2)
    push_round(shards, [0, 1], 0)
    push_round(shards, [0], 1)  # rank 1's old process died before pushing round 1 anywhere
    first = shards[0].join(1, 2, 2)  # the new process: shard 0 decides it counts from round 2
    assert first.clock == 2 and shards[0].version == 2  # round 1 went on without it
    relay(shards)
    assert shards[1].version == 2 and shards[1].join(1, 2, 2).clock == 2  # the same round on shard 1
    push_round(shards, [0], 2)
    for s in shards:
        s.push(PushStamp(1, 2, 2), 2, PLAN, wire(s.shard_index, 1.0))
    assert [s.version for s in shards] == [3, 3]
    restored = Shard(0, 2, ModeSettings("sync", num_workers=2))
    restored.restore(shards[0].export_state())  # a whole job resumed: its first joins are no restarts
    restored.join(0, 2, 3)
    assert restored.join(1, 2, 3).clock == 3 and restored.members[1].since == 2


def test_a_relayed_record_must_be_signed_by_shard_0_and_within_bounds() -> None:
    clock = FakeClock()
    shards = [Shard(k, 2, ModeSettings("sync", num_workers=2), now=clock, record_key="the-admin-token") for k in (0, 1)]
    shards[0].evict(1)
    record = shards[0].epochs.record
    assert len(record.signature) == 32
    forged = ps_pb2.MembershipEpoch()
    forged.CopyFrom(record)
    forged.num_workers = 1  # a worker (which relays records) alters one: refused, nothing changes
    with pytest.raises(InvalidRequestError, match="not signed by shard 0"):
        shards[1].adopt(forged)
    assert shards[1].epochs.epoch == 0 and shards[1].members[1].counted
    unsigned = ps_pb2.MembershipEpoch(epoch=record.epoch + 1, num_workers=2)
    with pytest.raises(InvalidRequestError, match="not signed"):
        shards[1].adopt(unsigned)
    assert shards[1].adopt(record) and not shards[1].members[1].counted  # shard 0's own record is followed
    keyless = Shard(1, 2, ModeSettings("sync", num_workers=2))  # a cluster without tokens: bounds still hold
    huge = ps_pb2.MembershipEpoch(epoch=9, num_workers=10**9)
    with pytest.raises(InvalidRequestError, match="at most 65536"):
        keyless.adopt(huge)
    with pytest.raises(InvalidRequestError, match="in order"):
        keyless.adopt(ps_pb2.MembershipEpoch(epoch=9, num_workers=2, members=[ps_pb2.EpochMember(rank=1)]))
    assert keyless.num_workers == 2 and keyless.epochs.epoch == 0


def test_scheduled_changes_are_bounded_and_a_default_one_comes_after_those_scheduled() -> None:
    shard = cluster(num_workers=2)[0]
    for v in range(5, 5 + 16):
        shard.update_config(learning_rate=0.01, at_version=v)
    with pytest.raises(PreconditionError, match="16 configuration changes are scheduled"):
        shard.update_config(learning_rate=0.02)
    assert len(shard.epochs.pending()) == 16  # none pushed out
    other = cluster(num_workers=2)[0]
    other.update_config(sync_quorum=1, at_version=9)
    other.update_config(learning_rate=0.02)  # by default after the change scheduled at 9, not before
    assert [c.version for c in other.epochs.pending()] == [9, 9]


@pytest.mark.parametrize("relay_between", [True, False])
def test_a_resize_supersedes_a_pending_one_and_no_round_waits_for_a_rank_it_added(relay_between: bool) -> None:
    # before: Resize(3) then Resize(2) before the next round made round 1 wait for rank 2 forever
    shards = cluster(num_workers=2)
    push_round(shards, [0, 1], 0)
    assert shards[0].resize(3) == (2, 2)
    if relay_between:
        relay(shards)
    assert shards[0].resize(2) == (3, 2)
    relay(shards)
    push_round(shards, [0, 1], 1)
    push_round(shards, [0, 1], 2)
    assert [s.version for s in shards] == [3, 3] and [s.num_workers for s in shards] == [2, 2]
    assert [s.status().round_waiting_for for s in shards] == [(), ()]
    for s in shards:
        with pytest.raises((NotJoinedError, InvalidRequestError), match="num_workers=2"):
            s.join(2, 2, 1)  # out of the cluster: resized away, or never added (shard 1 saw one record)


def test_rapid_resizes_end_on_the_last_count() -> None:
    shards = cluster(num_workers=2)
    push_round(shards, [0, 1], 0)
    for n in [3, 5, 1, 4, 2, 6, 3] * 7 + [2]:  # 50 resizes before the next round
        shards[0].resize(n)
        relay(shards)
    for clock in (1, 2, 3):
        push_round(shards, [0, 1], clock)
    assert [s.version for s in shards] == [4, 4]
    assert [len([m for m in s.members if m.counted]) for s in shards] == [2, 2]


def test_a_shrink_superseded_by_a_grow_keeps_the_rank_it_had() -> None:
    shards = cluster(num_workers=3)
    push_round(shards, [0, 1, 2], 0)
    shards[0].resize(2)
    shards[0].resize(3)  # back before it held: rank 2 (live) is kept as it is
    relay(shards)
    push_round(shards, [0, 1, 2], 1)
    push_round(shards, [0, 1, 2], 2)
    assert [s.version for s in shards] == [3, 3]
    assert [s.members[2].state for s in shards] == [WorkerState.LIVE] * 2


def lapse(shards: list[Shard], clock: FakeClock, silent: int) -> list[int]:
    """Let rank ``silent``'s lease lapse while the others heartbeat; returns shard 0's evictions."""
    evicted: list[int] = []
    for _ in range(6):
        clock.t += 1.0
        for r in range(len(shards[0].members)):
            if r != silent:
                shards[0].heartbeat(r, 1)
        evicted += shards[0].expire_leases()
    return evicted


def first_value(shard: Shard) -> float:
    assert shard.store is not None
    return float(shard.store.tensors[0][0])


def test_a_rank_evicted_after_its_push_reached_shard_0_only_counts_in_that_round_on_every_shard() -> None:
    """docs/faults.md#rounds-atomic-across-shards: a paused rank's push held by shard 0 counts in its round
    on every shard; the other shards wait for it there (the rank resumes and delivers it) and drop
    none of it."""
    clock = FakeClock()
    shards = cluster(clock=clock)
    push_round(shards, [0, 1, 2], 0)
    shards[0].push(PushStamp(2, 1, 1), 1, PLAN, wire(0, 4.0))  # reached shard 0, then SIGSTOP
    push_round(shards, [0, 1], 1)
    assert lapse(shards, clock, silent=2) == [2]
    assert shards[0].version == 2 and shards[0].members[2].until == 2  # shard 0 closed round 1 with rank 2
    relay(shards)
    assert shards[1].version == 1 and shards[1].status().round_waiting_for == (2,)  # the same ranks here
    shards[1].push(PushStamp(2, 1, 1), 1, PLAN, wire(1, 4.0))  # resumed: its push lands, evicted
    assert [s.version for s in shards] == [2, 2]
    assert first_value(shards[0]) == first_value(shards[1]) == 1.0 - 0.5 - 0.5 * (1 + 1 + 4) / 3
    for s in shards:  # its next round is no longer counted: it rejoins (shard 0 first)
        with pytest.raises(NotJoinedError):
            s.push(PushStamp(2, 1, 2), 2, PLAN, wire(s.shard_index, 1.0))


def test_a_rank_evicted_before_its_push_reached_shard_0_counts_in_that_round_on_no_shard() -> None:
    clock = FakeClock()
    shards = cluster(clock=clock)
    push_round(shards, [0, 1, 2], 0)
    shards[1].push(PushStamp(2, 1, 1), 1, PLAN, wire(1, 4.0))  # reached shard 1 only, then SIGSTOP
    push_round(shards[:1], [0, 1], 1)
    assert lapse(shards, clock, silent=2) == [2]
    assert shards[0].version == 2 and shards[0].members[2].until == 1  # round 1 closed without rank 2
    relay(shards)  # shard 1 drops its push of round 1 ...
    with pytest.raises(NotJoinedError, match="push of round 1 is not counted"):  # its waiting read is told
        shards[1].pull(2, 1, 2, PLAN.digest, timeout=1.0)
    push_round(shards[1:], [0, 1], 1)
    assert [s.version for s in shards] == [2, 2]
    assert first_value(shards[0]) == first_value(shards[1]) == 1.0 - 0.5 - 0.5  # ... and closes it without
    assert shards[0].lost_round == shards[1].lost_round == ""


def test_a_round_a_follower_closed_with_a_push_shard_0_never_took_is_named_not_applied_on() -> None:
    clock = FakeClock()
    shards = cluster(clock=clock)
    push_round(shards, [0, 1, 2], 0)
    push_round(shards[1:], [0, 1, 2], 1)  # rank 2 pushed round 1 to shard 1, then stopped before shard 0
    push_round(shards[:1], [0, 1], 1)
    assert lapse(shards, clock, silent=2) == [2]
    relay(shards)  # shard 1 closed round 1 with rank 2, shard 0 without: it says so, never silently
    assert "cannot close round 1" in shards[1].lost_round
    with pytest.raises(PreconditionError, match="restart the job from its newest checkpoints"):
        shards[1].push(PushStamp(0, 1, 2), 2, PLAN, wire(1, 1.0))
    with pytest.raises(PreconditionError, match="cannot close round 1"):
        shards[1].pull(0, 1, 3, PLAN.digest, timeout=1.0)


def test_ranks_counted_from_a_round_after_one_nobody_pushes_count_from_it_on_every_shard() -> None:
    """Rank 1 rejoins while rank 0 may still push the open round 2 (so it counts from round 3);
    rank 0 then leaves without pushing round 2 (its job was done). Nobody would push round 2 and
    rank 1 would wait for version 3 for ever: it counts from round 2 on every shard, its waiting
    read is told so, and its next Join says so."""
    shards = cluster(num_workers=2)
    push_round(shards, [0, 1], 0)
    shards[0].evict(1)
    relay(shards)
    push_round(shards, [0], 1)  # round 1 without rank 1
    assert shards[0].join(1, 2, 1).clock == 3  # rank 0 is live: rank 1 counts from the next round
    relay(shards)
    assert shards[1].join(1, 2, 1).clock == 3
    shards[0].leave(0, 1)
    with pytest.raises(NotJoinedError, match="counts from round 2 now"):
        shards[0].pull(1, 1, 3, PLAN.digest, timeout=1.0)
    relay(shards)
    with pytest.raises(NotJoinedError, match="counts from round 2 now"):
        shards[1].pull(1, 1, 3, PLAN.digest, timeout=1.0)
    for s in shards:
        assert s.join(1, 2, 1).clock == 2 and s.members[1].since == 2
        assert s.pull(1, 1, 2, PLAN.digest, timeout=1.0)[0] == 2  # at once: no refusal left behind
    push_round(shards, [1], 2)
    assert [s.version for s in shards] == [3, 3]


def test_a_rank_counted_from_a_later_round_waits_on_a_shard_restarted_behind_it() -> None:
    """Rank 1 rejoins counting from round 5 while shard 1 restarted at version 1: its read of
    version 5 there waits for the rounds rank 0 pushes again (no OUT_OF_RANGE), and ends with them."""
    shards = cluster(num_workers=2)
    push_round(shards, [0, 1], 0)
    old = shards[1].export_state()  # shard 1's newest checkpoint: version 1
    shards[0].evict(1)
    relay(shards)
    for c in range(1, 4):
        push_round(shards, [0], c)
    assert shards[0].join(1, 2, 1).clock == 5  # rank 0 is live: from the next round
    shards[1] = Shard(1, 2, ModeSettings("sync", num_workers=2), lease_timeout=5.0, now=FakeClock())
    shards[1].restore(old)  # killed and restarted behind
    relay(shards)
    shards[1].join(0, 2, 1)
    assert shards[1].join(1, 2, 1).clock == 5
    with ThreadPoolExecutor(1) as pool:  # it waits for rounds 1..4, which need no push of rank 1
        read = pool.submit(shards[1].pull, 1, 1, 5, PLAN.digest, timeout=10.0)
        for c in range(1, 5):
            shards[1].push(PushStamp(0, 1, c), c, PLAN, wire(1, 1.0))
        assert read.result(timeout=10)[0] == 5
