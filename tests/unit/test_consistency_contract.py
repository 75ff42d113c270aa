"""The consistency-policy contract: every policy of ``POLICIES`` through one list of cases, then the
cases only some modes have (in the style of torch elastic's rendezvous backend tests: one abstract
case list, every backend). Real shards, no sockets, no sleeping."""

from __future__ import annotations

import pytest
import torch

from ps_common.errors import FutureRoundError, PreconditionError, StalePushError, WaitTimeoutError
from ps_common.modes import MODES, ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_common.partition import WirePartition
from ps_common.plan import ParameterSpec, make_plan
from ps_common.tables import RowOptimizerSpec, TableSpec
from ps_proto.v1 import ps_pb2
from ps_server.policy import POLICIES, ConsistencyPolicy
from ps_server.shard.shard import PushStamp, Shard
from tests.helpers.tensors import encode

PLAN = make_plan([ParameterSpec("w", (3,), "float32")], 1)

# What each mode answers to the shared cases (docs/architecture.md#3-staleness and docs/architecture.md#5-consistency).
EXPECTED = {
    #        staleness unit, push applied at once, push held for its round, read after push of clock c
    "sync": ("", False, True, lambda c: c + 1),
    "async": ("versions", True, False, lambda c: 0),
    "ssp": ("clocks", True, False, lambda c: 0),
    "easgd": ("", False, False, lambda c: 0),
    "diloco": ("", False, True, lambda c: c + 1),  # an outer round is a sync round
}

# What each mode does with embedding-table rows and its ranks: serves tables, row pushes join table
# rounds, the cluster may be resized, a round may stream (without a quorum).
TABLES = {
    "sync": (True, True, True, True),
    "async": (True, False, True, False),
    "ssp": (True, False, True, False),
    "easgd": (False, False, False, False),
    "diloco": (False, True, True, False),  # no tables, resized at an outer round, weights known at the close
}


def wire(x: float | torch.Tensor) -> list[WirePartition]:
    values = x if isinstance(x, torch.Tensor) else torch.full((3,), float(x))
    return [WirePartition("w", 0, 3, "float32", encode(values))]


def make_shard(mode: str, n: int = 2, lr: float = 1.0, **kw: object) -> Shard:
    """An initialized shard of ``n`` joined ranks, w = 0, plain SGD with learning rate ``lr``."""
    shard = Shard(0, 1, ModeSettings(mode, num_workers=n, **kw))  # type: ignore[arg-type]
    for r in range(n):
        shard.join(r, n, 1)
    shard.init(PLAN.specs, 1, PLAN.partition_bytes, PLAN.digest, OptimizerSpec("sgd", {"lr": lr}), wire(0.0))
    return shard


def w(shard: Shard) -> torch.Tensor:
    assert shard.store is not None
    return shard.store.tensors[0].clone()


@pytest.fixture(params=sorted(POLICIES))
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


# ---------------------------------------------------------------- every policy


def test_the_registry_has_one_policy_per_mode() -> None:
    assert sorted(POLICIES) == sorted(MODES)
    for name, policy in POLICIES.items():
        assert isinstance(policy, ConsistencyPolicy) and policy.mode == name


def test_the_shard_serves_the_policy_of_its_mode(mode: str) -> None:
    assert make_shard(mode).policy is POLICIES[mode]


def test_staleness_is_counted_in_the_unit_design_names(mode: str) -> None:
    assert POLICIES[mode].staleness_unit == EXPECTED[mode][0]


def test_a_push_is_applied_held_or_refused(mode: str) -> None:
    shard = make_shard(mode)
    _, at_once, held, _ = EXPECTED[mode]
    if mode == "easgd":
        with pytest.raises(PreconditionError, match="call Exchange"):
            shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))
        assert shard.version == 0 and torch.equal(w(shard), torch.zeros(3))
        return
    result = shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))
    assert result.mode == mode and not result.duplicate
    assert shard.version == (1 if at_once else 0)
    assert (0 in shard.rounds.pending) is held
    assert shard.members[0].clock == 1  # the shard counts the rank's clock, whatever the mode


def test_a_repeated_stamp_is_answered_once(mode: str) -> None:
    shard = make_shard(mode)
    if POLICIES[mode].exchanges:
        first = shard.exchange(PushStamp(0, 1, 0), PLAN.digest, wire(2.0), timeout=1.0)
        again = shard.exchange(PushStamp(0, 1, 0), PLAN.digest, wire(2.0), timeout=1.0)
        assert again[0] == first[0] and all(torch.equal(a, b) for a, b in zip(again[1], first[1], strict=True))
        assert shard.version == 1
        return
    first = shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))
    again = shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))
    assert again.duplicate and again.version == first.version and shard.members[0].pushes == 1


def test_a_read_of_the_current_version_is_served_at_once(mode: str) -> None:
    shard = make_shard(mode)
    version, tensors = shard.pull(0, 1, shard.version, PLAN.digest, timeout=0.0)
    assert version == 0 and torch.equal(tensors[0], torch.zeros(3))
    member = shard.members[0]
    assert POLICIES[mode].can_read(shard, member, True, shard.version)


def test_the_read_after_a_push(mode: str) -> None:
    for clock in (0, 5):
        assert POLICIES[mode].read_after_push(clock) == EXPECTED[mode][3](clock)


def test_a_blocked_read_says_what_to_check(mode: str) -> None:
    text = POLICIES[mode].blocked(make_shard(mode), make_shard(mode).members[0], 3, 1.5)
    assert "check" in text and text.endswith(".")


def test_advance_with_nothing_complete_changes_nothing(mode: str) -> None:
    shard = make_shard(mode)
    before = (shard.version, w(shard))
    with shard._cond:
        POLICIES[mode].advance(shard)
    assert shard.version == before[0] and torch.equal(w(shard), before[1])


def test_a_rank_that_joins_again_under_its_incarnation_keeps_its_clock(mode: str) -> None:
    shard = make_shard(mode)
    shard.members[0].clock = 3
    if POLICIES[mode].holds_pushes:
        shard.rounds.round = 3  # and a rank of a round policy pushes the open round next
    assert shard.join(0, 2, 1).clock == 3


def test_only_easgd_takes_exchanges(mode: str) -> None:
    shard = make_shard(mode)
    if POLICIES[mode].exchanges:
        version, d = shard.exchange(PushStamp(0, 1, 0), PLAN.digest, wire(2.0), timeout=1.0)
        assert version == 1 and torch.allclose(d[0], torch.full((3,), 2.0 * shard.settings.moving_rate))
    else:
        with pytest.raises(PreconditionError, match="Exchange is for easgd"):
            shard.exchange(PushStamp(0, 1, 0), PLAN.digest, wire(2.0), timeout=1.0)


# ---------------------------------------------------------------- async and ssp: applied at once


@pytest.mark.parametrize("stale_mode", ["async", "ssp"])
def test_a_push_applies_with_the_policy_s_learning_rate_scale(stale_mode: str) -> None:
    """async ``--staleness-lr inverse``: lr / max(1, tau) (Zhang et al. 2016); ssp: the full lr,
    whatever the staleness (its bound is on reads)."""
    shard = make_shard(stale_mode, n=1, staleness_lr="inverse")  # ssp: not its rule
    shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))  # w = -1
    shard.push(PushStamp(0, 1, 1), 1, PLAN, wire(1.0))  # w = -2, version 2
    result = shard.push(PushStamp(0, 1, 2), 0, PLAN, wire(1.0))  # computed on version 0: tau = 2
    assert result.staleness == 2
    expected = -2.5 if stale_mode == "async" else -3.0
    assert torch.equal(w(shard), torch.full((3,), expected))


def test_async_refuses_a_push_beyond_max_staleness_and_counts_it() -> None:
    shard = make_shard("async", n=1, max_staleness=0)
    shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))
    with pytest.raises(StalePushError, match="--max-staleness 0"):
        shard.push(PushStamp(0, 1, 1), 0, PLAN, wire(1.0))
    assert shard.version == 1 and shard.status().rejected_pushes == {"stale": 1}


def test_async_staleness_is_versions_and_ssp_staleness_is_the_clock_gap() -> None:
    asynchronous, ssp = make_shard("async"), make_shard("ssp", staleness=5)
    for shard in (asynchronous, ssp):
        for clock in range(3):
            shard.push(PushStamp(0, 1, clock), clock, PLAN, wire(0.0))
    assert asynchronous.policy.staleness(asynchronous, asynchronous.members[1], 0) == 3  # versions behind
    assert ssp.policy.staleness(ssp, ssp.members[0], 0) == 3  # rank 0 is 3 clocks ahead of rank 1
    assert ssp.policy.staleness(ssp, ssp.members[1], 0) == 0


# ---------------------------------------------------------------- ssp: bounded reads, rejoin


def test_ssp_blocks_a_reader_more_than_s_clocks_ahead() -> None:
    shard = make_shard("ssp", staleness=1)
    for clock in range(2):
        shard.push(PushStamp(0, 1, clock), clock, PLAN, wire(0.0))
    with pytest.raises(WaitTimeoutError, match="Rank 0 at clock 2 may read once every live rank reaches clock 1"):
        shard.pull(0, 1, 0, PLAN.digest, timeout=0.0)
    shard.push(PushStamp(1, 1, 0), 0, PLAN, wire(0.0))
    assert shard.pull(0, 1, 0, PLAN.digest, timeout=0.0)[0] == 3
    assert shard.status().max_clock_gap == 1


def test_ssp_a_restarted_rank_resumes_at_the_slowest_live_clock() -> None:
    """Not its own clock (it would race ahead or block), not the fastest (it would block the reads
    of every rank behind it): the slowest live rank's."""
    shard = make_shard("ssp", n=3, staleness=10)
    for rank, clocks in ((0, 6), (1, 2), (2, 4)):
        for clock in range(clocks):
            shard.push(PushStamp(rank, 1, clock), shard.version, PLAN, wire(0.0))
    assert [m.clock for m in shard.members] == [6, 2, 4]
    assert shard.join(2, 3, 2).clock == 2
    assert shard.members[2].clock == 2


# ---------------------------------------------------------------- sync: rounds


def test_sync_holds_pushes_until_the_round_is_complete_then_reads_its_version() -> None:
    shard = make_shard("sync")
    shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))
    with pytest.raises(WaitTimeoutError, match="round waits for ranks \\[1\\]"):
        shard.pull(0, 1, 1, PLAN.digest, timeout=0.0)
    shard.push(PushStamp(1, 1, 0), 0, PLAN, wire(3.0))
    assert shard.version == 1 and torch.equal(w(shard), torch.full((3,), -2.0))  # mean of 1 and 3, lr 1


def test_sync_a_joining_rank_pushes_the_open_round() -> None:
    shard = make_shard("sync")
    for r in range(2):
        shard.push(PushStamp(r, 1, 0), 0, PLAN, wire(1.0))
    assert shard.join(1, 2, 2).clock == 2  # a restarted process: from shard 0's next round, on every shard


def test_a_mode_switch_swaps_the_policy_at_the_round_boundary() -> None:
    shard = make_shard("sync")
    shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(1.0))
    shard.update_config(mode="async")
    assert shard.policy is POLICIES["sync"] and shard.status().pending_mode == "async"
    shard.push(PushStamp(1, 1, 0), 0, PLAN, wire(1.0))  # closes round 0: the switch happens
    assert shard.policy is POLICIES["async"] and shard.status().pending_mode == ""
    assert shard.push(PushStamp(0, 1, 1), 1, PLAN, wire(1.0)).version == 2  # applied at once


# ---------------------------------------------------------------- every policy: embedding tables and ranks

TABLE = TableSpec("emb.weight", 100, 2, RowOptimizerSpec("sgd", {"lr": 1.0}))


def table_shard(mode: str, n: int = 2) -> tuple[Shard, list[int]]:
    """A shard of ``n`` joined ranks with TABLE declared by rank 0; returns it and each rank's session."""
    shard = Shard(0, 1, ModeSettings(mode, num_workers=n))
    sessions = [shard.join(r, n, 1).session for r in range(n)]
    applied, version, clock, specs = shard.init_tables(0, 1, [TABLE], 1.0)
    assert applied and version == 0 and clock == 0 and specs == [TABLE]
    return shard, sessions


def rows(ids: list[int], value: float) -> list[ps_pb2.RowBlock]:
    """One PushRows block of TABLE: ``value`` in every element of each row of ``ids``."""
    grads = torch.full((len(ids), TABLE.dim), value, dtype=torch.float32)
    raw_ids = torch.tensor(ids, dtype=torch.int64).numpy().tobytes()
    return [ps_pb2.RowBlock(table=TABLE.name, ids=raw_ids, dtype=ps_pb2.DTYPE_FLOAT32, data=grads.numpy().tobytes())]


def read(shard: Shard, ids: list[int], min_version: int = 0, timeout: float = 0.0) -> tuple[int, torch.Tensor]:
    """PullRows of TABLE's ``ids`` by rank 0, on the calling thread."""
    blocks = [ps_pb2.RowBlock(table=TABLE.name, ids=torch.tensor(ids, dtype=torch.int64).numpy().tobytes())]
    version, tensors = shard.pull_rows(0, 1, blocks, min_version, timeout, lambda run: run())
    return version, tensors[0]


def test_the_policy_says_what_a_mode_does_with_rows_and_ranks(mode: str) -> None:
    policy = POLICIES[mode]
    serves, row_rounds, resizable, streams = TABLES[mode]
    assert policy.row_rounds is row_rounds and policy.resizable is resizable
    assert policy.may_stream(ModeSettings(mode, num_workers=2)) is streams
    assert not policy.may_stream(ModeSettings(mode, num_workers=2, sync_quorum=1))  # a quorum round never streams
    if serves:
        policy.check_rows()
    else:
        with pytest.raises(PreconditionError, match=f"not served in {mode}"):
            policy.check_rows()
        shard = Shard(0, 1, ModeSettings(mode, num_workers=2))
        shard.join(0, 2, 1)
        with pytest.raises(PreconditionError, match=f"not served in {mode}"):  # InitTables too: nothing declared
            shard.init_tables(0, 1, [TABLE], 1.0)
        assert not shard.tables.tables


def test_the_row_clock_is_the_open_table_round_or_one_past_the_high_water_mark(mode: str) -> None:
    policy = POLICIES[mode]
    if policy.row_rounds:
        assert [policy.row_clock(5, last) for last in (None, 2, 9)] == [5, 5, 5]
    else:
        assert [policy.row_clock(5, last) for last in (None, 2, 9)] == [0, 3, 10]


def test_a_row_push_is_held_for_its_round_applied_at_once_or_refused(mode: str) -> None:
    if not TABLES[mode][0]:  # InitTables is refused too (above): a row push without tables
        shard = Shard(0, 1, ModeSettings(mode, num_workers=2))
        session = shard.join(0, 2, 1).session
        with pytest.raises(PreconditionError, match="no tables yet"):
            shard.push_rows(0, 1, session, 0, rows([3], 1.0))
        assert shard.tables.version == 0 and not shard.tables.tables
        return
    shard, sessions = table_shard(mode)
    before = read(shard, [3])[1]
    assert shard.push_rows(0, 1, sessions[0], 0, rows([3], 1.0)) == (0 if TABLES[mode][1] else 1, False)
    if TABLES[mode][1]:  # held: the table round closes once rank 1 pushed it too
        assert shard.tables.version == 0 and list(shard.tables.held) == [0]
        with pytest.raises(WaitTimeoutError, match="ranks \\[1\\] have not pushed rows"):
            read(shard, [3], min_version=1)
        assert shard.push_rows(1, 1, sessions[1], 0, rows([3], 3.0)) == (0, False)
        assert torch.equal(read(shard, [3], min_version=1)[1], before - 2.0)  # mean of 1 and 3, lr 1
    else:
        assert torch.equal(read(shard, [3])[1], before - 1.0)
    assert shard.tables.version == 1
    assert shard.push_rows(0, 1, sessions[0], 0, rows([3], 1.0))[1]  # a repeat changes nothing
    assert shard.tables.version == 1
    assert shard.init_tables(0, 1, [TABLE], 1.0)[2] == 1  # rank 0's next clock, every mode


def test_only_row_rounds_refuse_a_row_push_for_a_future_round(mode: str) -> None:
    if not TABLES[mode][0]:
        return
    shard, sessions = table_shard(mode)
    if POLICIES[mode].row_rounds:
        with pytest.raises(FutureRoundError, match="table round 4"):
            shard.push_rows(0, 1, sessions[0], 4, rows([1], 1.0))
        assert shard.tables.version == 0
    else:
        assert shard.push_rows(0, 1, sessions[0], 4, rows([1], 1.0)) == (1, False)
        assert shard.tables.clock_of(shard.policy, 0, 1) == 5


def test_a_table_round_closes_when_an_eviction_completes_it_and_a_waiting_read_sees_it() -> None:
    shard, sessions = table_shard("sync")
    shard.push_rows(0, 1, sessions[0], 0, rows([7], 2.0))
    shard.evict(1)
    version, values = read(shard, [7], min_version=1)  # the wait closes the round of rank 0 alone
    assert version == 1 and shard.tables.version == 1


def test_only_a_resizable_mode_resizes(mode: str) -> None:
    shard = make_shard(mode)
    if POLICIES[mode].resizable:
        assert shard.resize(3)[0] == 2
    else:
        with pytest.raises(PreconditionError, match="an easgd job keeps its workers"):
            shard.resize(3)


def test_diloco_weighs_a_zero_count_as_nothing_and_a_round_of_zero_counts_as_no_update() -> None:
    """FedAvg (McMahan et al. 2017): ``sum_k n_k / n * delta_k`` over the ranks that counted; a count
    of 0 is a weight of 0, distinct from no count at all (the field unset: the plain mean)."""
    shard = make_shard("diloco")  # w = 0, SGD lr 1: w -= the round's outer gradient
    w = lambda: shard.store.tensors[0].clone()  # noqa: E731
    shard.push(PushStamp(0, 1, 0, 3), 0, PLAN, wire(1.0))
    shard.push(PushStamp(1, 1, 0, 0), 0, PLAN, wire(5.0))
    assert torch.equal(w(), torch.full((3,), -1.0))  # rank 1 weighs 0
    shard.push(PushStamp(0, 1, 1, 0), 1, PLAN, wire(1.0))
    shard.push(PushStamp(1, 1, 1, 0), 1, PLAN, wire(5.0))
    assert shard.version == 2 and torch.equal(w(), torch.full((3,), -1.0))  # no samples anywhere: no update
    shard.push(PushStamp(0, 1, 2), 2, PLAN, wire(1.0))
    shard.push(PushStamp(1, 1, 2), 2, PLAN, wire(5.0))
    assert torch.equal(w(), torch.full((3,), -4.0))  # nobody counts: the plain mean, 3
