"""ps_worker.session: stamps, pull floors and recovery decisions, against a fake transport (no sockets)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from ps_common import errors
from ps_common.errors import Reason
from ps_proto.v1 import ps_pb2
from ps_worker.session import Session
from ps_worker.transport.retry import CallPolicy


class Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, reason: str = "", details: str = "refused") -> None:
        self._code, self._reason, self._details = code, reason, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("ps-reason", self._reason),) if self._reason else ()


class FakeStub:
    def __init__(self, k: int, num_shards: int, version: int) -> None:
        self.k, self.num_shards, self.version = k, num_shards, version
        self.joins = 0

    def Heartbeat(self, req: ps_pb2.HeartbeatRequest, **kwargs: Any) -> ps_pb2.HeartbeatResponse:  # noqa: N802
        return ps_pb2.HeartbeatResponse()

    def Join(self, req: ps_pb2.JoinRequest, **kwargs: Any) -> ps_pb2.JoinResponse:  # noqa: N802 - gRPC's name
        self.joins += 1
        config = ps_pb2.ClusterConfig(mode=ps_pb2.MODE_SYNC, num_workers=2, communication_period=10)
        return ps_pb2.JoinResponse(
            shard_index=self.k,
            num_shards=self.num_shards,
            version=self.version,
            clock=self.version,
            initialized=True,
            plan_digest="d",
            config=config,
            data_port=6000 + self.k,
        )


class FakeTransport:
    """What Session uses of a Transport: servers, stubs, deadlines, fan-out and calls (no retries)."""

    def __init__(self, num_shards: int = 2, version: int = 4) -> None:
        self.servers = [f"h:{k}" for k in range(num_shards)]
        self.stubs = [FakeStub(k, num_shards, version) for k in range(num_shards)]
        self.timeout, self.retry_deadline, self.metadata = 1.0, 1.0, ()
        self.closed = False
        self.data_ports = [-1] * num_shards

    @property
    def num_shards(self) -> int:
        return len(self.servers)

    def each_shard(self, fn: Callable[[int], Any]) -> list[Any]:
        return [fn(k) for k in range(self.num_shards)]

    policy = CallPolicy(0.0)  # no time to retry in: a transient failure is raised

    def call(self, fn: Callable[[], Any], what: str) -> Any:
        return fn()

    def close(self, leave: Any = None, told: Any = None) -> None:
        self.closed = True

    def offer_data_port(self, k: int, port: int, joined: bool = True) -> None:
        self.data_ports[k] = port


def joined(version: int = 4) -> tuple[Session, FakeTransport]:
    t = FakeTransport(version=version)
    s = Session(t, rank=1, num_workers=2, incarnation=9)  # type: ignore[arg-type]
    s.plan_digest = "d"
    s.heartbeat.start = lambda lease_timeout: None  # type: ignore[method-assign]  # no thread here
    s.join()
    return s, t


def failing(*refusals: grpc.RpcError) -> Callable[[], str]:
    left = list(refusals)

    def fn() -> str:
        if left:
            raise left.pop(0)
        return "done"

    return fn


def test_join_takes_mode_settings_and_progress_from_the_shards() -> None:
    s, t = joined(version=4)
    assert t.data_ports == [6000, 6001]  # each shard's data port goes to the transport
    assert s.mode == "sync" and s.worker.name == "sync" and s.clock == 4
    assert s.settings is not None and s.settings.communication_period == 10 and s.settings.num_workers == 2
    s.versions = [4, 5]
    s.pushed = [True, False]
    assert [s.stamp(k).clock for k in range(2)] == [4, 4]  # sync: one round, the lowest, to every shard
    assert [s.pull_floor(k, None) for k in range(2)] == [5, 5] and s.pull_floor(0, 0) == 0


@pytest.mark.parametrize("reason", [Reason.NOT_JOINED, Reason.FUTURE_ROUND])
def test_a_fixable_refusal_rejoins_and_retries(reason: Reason) -> None:
    s, t = joined()
    s.pushed = [True, True]
    before = t.stubs[0].joins
    refusal = Refusal(grpc.StatusCode.FAILED_PRECONDITION, reason.value)
    assert s.with_recovery(0, failing(refusal), "Pull h:0") == "done"
    assert t.stubs[0].joins == before + 1 and s.pushed == [False, True] and s.recoveries[reason.value] == 1


def test_a_lost_push_is_pushed_again_unless_the_call_pushes_itself() -> None:
    s, _ = joined()
    pushed_again: list[int] = []
    s.repush = pushed_again.append
    lost = Refusal(grpc.StatusCode.FAILED_PRECONDITION, "PUSH_LOST")
    s.with_recovery(1, failing(lost), "Pull h:1")
    s.with_recovery(1, failing(lost), "PushPull h:1", repush=False)
    assert pushed_again == [1] and s.recoveries["PUSH_LOST"] == 2


def test_rank_0_writes_a_shard_that_lost_its_values_again() -> None:
    s, _ = joined()
    s.rank = 0
    written: list[int] = []
    s.reinit = written.append
    s.with_recovery(1, failing(Refusal(grpc.StatusCode.FAILED_PRECONDITION, "NOT_INITIALIZED")), "Push h:1")
    assert written == [1]


def test_other_refusals_raise_typed_at_once_and_recoveries_are_bounded() -> None:
    s, _ = joined()
    with pytest.raises(errors.StalePushError) as stale:
        s.with_recovery(0, failing(Refusal(grpc.StatusCode.ABORTED, "STALE")), "Push h:0")
    assert stale.value.address == "h:0" and not s.recoveries
    with pytest.raises(errors.RoundTimeoutError):  # a wait without the shard's reason: the client's deadline
        s.with_recovery(0, failing(Refusal(grpc.StatusCode.DEADLINE_EXCEEDED)), "Pull h:0")
    evicted = [Refusal(grpc.StatusCode.FAILED_PRECONDITION, "NOT_JOINED") for _ in range(5)]
    with pytest.raises(errors.NotJoinedError):
        s.with_recovery(0, failing(*evicted), "Pull h:0")
    assert s.recoveries["NOT_JOINED"] == 3


def test_push_answers_move_the_clock_and_a_live_mode_switch() -> None:
    s, _ = joined()
    s.account_push([ps_pb2.PushResponse(mode=ps_pb2.MODE_ASYNC, staleness=2), ps_pb2.PushResponse()])
    assert s.clock == 5 and s.mode == "async" and s.settings is not None and s.settings.mode == "async"
    s.account_push([ps_pb2.PushResponse(staleness=2)])
    assert s.staleness[2] == 1  # async counts staleness; the sync push before it did not
    s.push_refused()
    assert s.clock == 7 and s.refused_pushes == 1
    assert s.adopt_versions([8, 6]) == 6 and s.pushed == [False, False]


def test_close_leaves_and_joins_the_heartbeat() -> None:
    t = FakeTransport()
    s = Session(t, rank=0, num_workers=2, incarnation=1)  # type: ignore[arg-type]
    s.heartbeat.start(1e-3)
    s.close()
    assert t.closed and s.heartbeat.thread is not None and not s.heartbeat.thread.is_alive()


def test_a_newer_membership_record_is_adopted_and_relayed_only_to_the_shards_behind() -> None:
    s, _ = joined()
    assert s.relayed(0) == (0, None) and s.relayed(1) == (0, None)
    record = ps_pb2.MembershipEpoch(epoch=5, num_workers=3, previous_num_workers=2, resize_version=7)
    resized: list[int] = []
    s.on_resize = lambda r: resized.append(r.num_workers)
    s.learn(0, ps_pb2.PushResponse(membership_epoch=5, membership=record))  # shard 0 decided a resize
    assert s.num_workers == 3 and resized == [3] and s.membership.epoch == 5
    assert s.relayed(0) == (5, None)  # shard 0 knows it
    epoch, relayed = s.relayed(1)  # shard 1 reported no epoch yet: it gets the record
    assert epoch == 5 and relayed is not None and relayed.num_workers == 3
    assert s.epochs.wake.is_set()  # the heartbeat thread relays it at once
    s.learn(1, ps_pb2.HeartbeatResponse(membership_epoch=5))
    assert s.relayed(1) == (5, None)
    s.learn(1, ps_pb2.PushResponse(membership_epoch=4, membership=ps_pb2.MembershipEpoch(epoch=4)))
    assert s.membership.epoch == 5  # an older record never wins


def test_a_resize_to_fewer_workers_ends_the_ranks_beyond_at_its_round() -> None:
    s, _ = joined()  # rank 1 of 2, sync
    shrink = ps_pb2.MembershipEpoch(epoch=2, num_workers=1, previous_num_workers=2, resize_version=10)
    s.learn(0, ps_pb2.JoinResponse(membership=shrink))
    assert s.in_cluster(9) and not s.in_cluster(10)
    s.mode = "async"  # no rounds: at once
    assert not s.in_cluster(9)


def test_a_rank_counted_again_from_a_later_round_drops_the_step_and_waits_for_that_round() -> None:
    s, t = joined(version=4)
    t.stubs[0].version = 4
    original = t.stubs[0].Join

    def later(req: ps_pb2.JoinRequest, **kw: Any) -> ps_pb2.JoinResponse:
        reply = original(req, **kw)
        reply.clock = 5  # shard 0 counts it from round 5; its version is 4
        return reply

    t.stubs[0].Join = later  # type: ignore[method-assign]
    with pytest.raises(errors.StalePushError, match="counts from round 5"):
        s.with_recovery(0, failing(Refusal(grpc.StatusCode.FAILED_PRECONDITION, Reason.NOT_JOINED.value)), "Push h:0")
    assert s.versions[0] == 5 and not s.pushed[0]
