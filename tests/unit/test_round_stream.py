"""Streamed sync rounds (ps_server.shard.round_stream) on the shard state machine, without gRPC: each slot
stepped once every rank's partition is in, bitwise the round applied at once; a stream that cannot
stand for its round puts every stepped slot back, and the round is applied (or refused) as usual."""

from __future__ import annotations

import pytest
import torch

from ps_common.errors import InvalidRequestError, NonFiniteUpdateError
from ps_common.modes import ModeSettings
from ps_common.optimizer import OPTIMIZERS, OptimizerSpec
from ps_common.partition import WirePartition
from ps_common.plan import ParameterSpec, make_plan
from ps_server.config import ServerConfig
from ps_server.shard import round_stream
from ps_server.shard.shard import PushStamp, Shard
from tests.helpers.tensors import encode

SPECS = [ParameterSpec("w", (6,), "float32"), ParameterSpec("b", (2,), "float32")]
PLAN = make_plan(SPECS, 1, 16)  # 16-byte partitions: w[0:4], w[4:6], b[0:2]
SLOTS = len(PLAN.owned_by(0))
MOMENTUM = OptimizerSpec("sgd", {"lr": 0.5, "momentum": 0.9})


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def grads(rank: int, clock: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * clock + rank)
    return [torch.randn(p.length, generator=g) for p in PLAN.owned_by(0)]


def wire(tensors: list[torch.Tensor]) -> list[WirePartition]:
    return [
        WirePartition(p.key, p.offset, p.length, "float32", encode(t))
        for p, t in zip(PLAN.owned_by(0), tensors, strict=True)
    ]


def make_shard(optimizer: OptimizerSpec = MOMENTUM, clock: FakeClock | None = None) -> Shard:
    s = Shard(0, 1, ModeSettings("sync", num_workers=2), lease_timeout=10.0, now=clock or FakeClock())
    s.join(0, 2, 1)
    s.join(1, 2, 1)
    s.init(SPECS, 1, 16, PLAN.digest, optimizer, wire([torch.ones(p.length) for p in PLAN.owned_by(0)]))
    return s


def values(shard: Shard) -> list[torch.Tensor]:
    assert shard.store is not None
    return [t.clone() for t in shard.store.tensors]


def join(shard: Shard, rank: int, clock: int, hyper=(), skip: bool = False) -> round_stream.RoundStream | None:
    with shard._cond:
        return round_stream.join(shard, PushStamp(rank, 1, clock), hyper, skip, "on")


def offer(shard: Shard, stream: round_stream.RoundStream, rank: int, clock: int, slots) -> None:
    g = grads(rank, clock)
    with shard._cond:
        for i in slots:
            round_stream.offer(shard, stream, rank, i, g[i])


def push(shard: Shard, rank: int, clock: int, stream=None, hyper=()) -> None:
    shard.push(PushStamp(rank, 1, clock), clock, PLAN, wire(grads(rank, clock)), hyper, stream=stream)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_streamed_round_is_bitwise_the_round_applied_at_once() -> None:
    streamed, whole = make_shard(), make_shard()
    for clock in range(3):
        s0, s1 = join(streamed, 0, clock), join(streamed, 1, clock)
        assert s0 is s1 is not None
        before = values(streamed)
        offer(streamed, s0, 1, clock, [2])
        offer(streamed, s0, 0, clock, [0, 2])
        # slot 2 has both ranks' partitions: stepped ahead of the round; slot 0 waits for rank 1
        assert s0.stepped == {2} and streamed.version == clock
        now = values(streamed)
        assert torch.equal(now[0], before[0]) and not torch.equal(now[2], before[2])
        offer(streamed, s0, 1, clock, [0, 1])
        offer(streamed, s0, 0, clock, [1])
        assert s0.stepped == {0, 1, 2} and streamed.version == clock  # closed only once both pushes are held
        push(streamed, 1, clock, s0)
        push(streamed, 0, clock, s0)
        assert streamed.version == clock + 1 and s0.committed
        push(whole, 0, clock)
        push(whole, 1, clock)
        assert same(values(streamed), values(whole))
        assert streamed.store is not None and whole.store is not None
        state = [streamed.store.optimizer.state[t]["momentum_buffer"] for t in streamed.store.trained]
        want = [whole.store.optimizer.state[t]["momentum_buffer"] for t in whole.store.trained]
        assert same(state, want)
    assert (streamed.streamed_rounds, streamed.unstreamed_rounds) == (3, 0)


@pytest.mark.parametrize("optimizer", sorted(set(OPTIMIZERS) - {"sgd"}))
def test_other_optimizers_step_a_slot_as_they_step_the_whole_round(optimizer: str) -> None:
    spec = OptimizerSpec(optimizer, {"lr": 0.01})
    streamed, whole = make_shard(spec), make_shard(spec)
    for clock in range(2):
        s = join(streamed, 0, clock)
        assert join(streamed, 1, clock) is s is not None
        for i in reversed(range(SLOTS)):  # any order
            offer(streamed, s, 0, clock, [i])
            offer(streamed, s, 1, clock, [i])
        push(streamed, 0, clock, s)
        push(streamed, 1, clock, s)
        push(whole, 0, clock)
        push(whole, 1, clock)
        assert same(values(streamed), values(whole))
    assert streamed.streamed_rounds == 2


def test_a_rank_evicted_mid_stream_puts_the_slots_back_and_the_round_goes_on_without_it() -> None:
    clocks = FakeClock(), FakeClock()
    streamed, whole = make_shard(clock=clocks[0]), make_shard(clock=clocks[1])
    start = values(streamed)
    s = join(streamed, 0, 0)
    assert join(streamed, 1, 0) is s is not None
    offer(streamed, s, 0, 0, range(SLOTS))
    offer(streamed, s, 1, 0, [0, 1])
    assert s.stepped == {0, 1}
    for shard, clock in zip((streamed, whole), clocks, strict=True):
        evicted = []
        for second in range(11):  # the lease reaper wakes every second; rank 1 stays silent
            clock.t += 1
            if second == 5:
                shard.heartbeat(0, 1)
            evicted += shard.expire_leases()
        assert evicted == [1]
    with streamed._cond:  # what a streaming call does when it wakes
        round_stream.step_ready(streamed, s)
    assert s.ended and same(values(streamed), start)
    push(streamed, 0, 0, s)  # the round closes with rank 0 alone, applied as usual
    push(whole, 0, 0)
    assert streamed.version == whole.version == 1 and same(values(streamed), values(whole))
    assert (streamed.streamed_rounds, streamed.unstreamed_rounds) == (0, 1)


def test_a_read_or_a_checkpoint_mid_round_sees_no_speculative_values() -> None:
    streamed, whole = make_shard(), make_shard()
    start = values(streamed)
    s = join(streamed, 0, 0)
    assert join(streamed, 1, 0) is s is not None
    offer(streamed, s, 0, 0, [0])
    offer(streamed, s, 1, 0, [0])
    assert s.stepped == {0}
    saved = streamed.export_state()
    assert same(saved["tensors"], start)
    assert s.ended and same(values(streamed), start)
    # the round goes the usual way: the same result as never streamed
    push(streamed, 0, 0, s)
    push(streamed, 1, 0, s)
    push(whole, 0, 0)
    push(whole, 1, 0)
    assert streamed.version == 1 and same(values(streamed), values(whole))
    # a read of the version while a stream steps puts the slots back too
    s = join(streamed, 0, 1)
    assert join(streamed, 1, 1) is s is not None
    offer(streamed, s, 0, 1, [1])
    offer(streamed, s, 1, 1, [1])
    assert s.stepped == {1}
    streamed.pull(0, 1, 1, PLAN.digest, timeout=1.0)
    assert s.ended and same(values(streamed), values(whole))


def test_a_slot_that_would_overflow_ends_the_stream_and_the_round_is_refused_whole() -> None:
    shard = make_shard(OptimizerSpec("sgd", {"lr": 1e38}))
    start = values(shard)
    s = join(shard, 0, 0)
    assert join(shard, 1, 0) is s is not None
    offer(shard, s, 0, 0, [0])
    offer(shard, s, 1, 0, [0])  # the first slot steps fine: 1 - 1e38 * g is finite for |g| < 3
    big = torch.full((PLAN.owned_by(0)[1].length,), 3e38)
    with shard._cond:
        round_stream.offer(shard, s, 0, 1, big)
        round_stream.offer(shard, s, 1, 1, big)
    assert s.ended and same(values(shard), start)
    shard.push(PushStamp(0, 1, 0), 0, PLAN, wire(grads(0, 0)), stream=s)
    with pytest.raises(NonFiniteUpdateError):
        shard.push(PushStamp(1, 1, 0), 0, PLAN, wire([grads(1, 0)[0], big, grads(1, 0)[2]]), stream=s)
    assert shard.version == 0 and same(values(shard), start)


def test_rounds_that_are_not_streamed() -> None:
    shard = make_shard()
    assert join(shard, 0, 0, skip=True) is None  # a skipped step has nothing to stream
    shard = make_shard()
    assert join(shard, 0, 0, hyper=({"lr": 0.1},)) is not None
    assert join(shard, 1, 0, hyper=({"lr": 0.2},)) is None  # disagreeing: the close refuses the round
    assert shard.stream is not None and shard.stream.ended
    shard = make_shard()
    with shard._cond:
        assert round_stream.join(shard, PushStamp(0, 1, 0), (), False, "off") is None
        assert round_stream.join(shard, PushStamp(0, 1, 1), (), False, "on") is None  # a future round
    one = Shard(0, 1, ModeSettings("sync", num_workers=1), now=FakeClock())
    one.join(0, 1, 1)
    one.init(SPECS, 1, 16, PLAN.digest, MOMENTUM, wire([torch.ones(p.length) for p in PLAN.owned_by(0)]))
    with one._cond:
        assert round_stream.join(one, PushStamp(0, 1, 0), (), False, "auto") is None  # one rank: auto is off
        assert round_stream.join(one, PushStamp(0, 1, 0), (), False, "on") is not None
    quorum = Shard(0, 1, ModeSettings("sync", num_workers=2, sync_quorum=1), now=FakeClock())
    quorum.join(0, 2, 1)
    quorum.init(SPECS, 1, 16, PLAN.digest, MOMENTUM, wire([torch.ones(p.length) for p in PLAN.owned_by(0)]))
    with quorum._cond:
        assert round_stream.join(quorum, PushStamp(0, 1, 0), (), False, "on") is None


def test_a_push_outside_the_stream_ends_it() -> None:
    shard, whole = make_shard(), make_shard()
    s = join(shard, 0, 0)
    assert join(shard, 1, 0) is s is not None
    offer(shard, s, 0, 0, range(SLOTS))
    offer(shard, s, 1, 0, range(SLOTS))
    assert s.stepped == set(range(SLOTS))
    push(shard, 0, 0, s)
    push(shard, 1, 0)  # rank 1's call failed and its retry came on gRPC: the stream cannot stand for it
    push(whole, 0, 0)
    push(whole, 1, 0)
    assert s.ended and shard.version == 1 and same(values(shard), values(whole))


def test_the_flag_is_checked() -> None:
    with pytest.raises(InvalidRequestError, match="--stream-rounds must be one of auto, on, off"):
        ServerConfig(shard_index=0, num_shards=1, num_workers=1, stream_rounds="sometimes")
    assert ServerConfig(shard_index=0, num_shards=1, num_workers=1).stream_rounds == "auto"
