"""The waiting calls' capacity cannot be held by one caller: a request stream that never sends its
first message is cancelled within min(10 s, the lease timeout), a push header without the rank's
session is refused before its partitions are read, and with per-rank tokens a rank that holds its
whole share of waiting calls does not stop another rank's training.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from ps_common.errors import reason_of
from ps_common.tables import RowOptimizerSpec, TableSpec
from ps_common.wire import table_spec_to_proto
from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_server.service.rank_tokens import RankTokens
from ps_server.service.waiting_calls import rank_share
from ps_worker import PSClient
from tests.conftest import small_model

TOKEN = "worker-secret"
WORKER = (("authorization", f"Bearer {TOKEN}"),)
CALL_TIMEOUT = 30.0
"""Deadline of an attacking call: far beyond what the test checks."""


class Stalled:
    """Request streams that send ``first`` messages (none: nothing at all) and then stall until
    :meth:`release`."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.calls: list[Any] = []

    def requests(self, first: list[Any]) -> Iterator[Any]:
        yield from first
        self.hold.wait(CALL_TIMEOUT)

    def release(self) -> None:
        self.hold.set()
        for call in self.calls:
            call.cancel()


@pytest.fixture
def stalled() -> Iterator[Stalled]:
    s = Stalled()
    yield s
    s.release()


def test_a_request_stream_that_sends_nothing_is_cancelled_and_its_slot_freed(start_cluster, stalled, wait_until):
    """Push, PushPull, Init and Exchange streams that never send a message: each is cancelled once
    the lease timeout (1 s here, under the 10 s cap) passed, and every slot comes back."""
    (server,) = start_cluster(1, num_workers=2, mode="sync", token=TOKEN, lease_timeout=1.0, join_timeout=0)
    assert server.waiting.first_message_seconds == 1.0
    with grpc.insecure_channel(server.address) as channel:
        stub = ps_pb2_grpc.ParameterServiceStub(channel)
        started = time.monotonic()
        for method in (stub.Push.future, stub.Init.future, stub.PushPull, stub.Exchange):
            stalled.calls.append(method(stalled.requests([]), timeout=CALL_TIMEOUT, metadata=WORKER))
        wait_until(lambda: server.waiting.open == 4, 10, "the four streams to be admitted")
        wait_until(lambda: server.waiting.open == 0, 10, "the silent streams to be cancelled")
        assert time.monotonic() - started < 10
        assert server.waiting.cut == 4
        for call in stalled.calls:
            with pytest.raises(grpc.RpcError) as err:
                call.result(timeout=5) if hasattr(call, "result") else list(call)
            assert err.value.code() == grpc.StatusCode.CANCELLED


def test_a_push_header_without_the_ranks_session_is_refused_before_its_partitions(
    start_cluster, stalled, wait_until
) -> None:
    """A PushPull whose header carries no (or another) session, then stalls: refused at once
    (FAILED_PRECONDITION NOT_JOINED), not held until the stream ends."""
    (server,) = start_cluster(1, num_workers=2, mode="sync", token=TOKEN, lease_timeout=30)
    with PSClient([server.address], rank=0, num_workers=2, timeout=10, token=TOKEN) as client:
        client.init(small_model(), {"name": "sgd", "lr": 0.1}, init_timeout=20)
        shard = server.shard
        with grpc.insecure_channel(server.address) as channel:
            stub = ps_pb2_grpc.ParameterServiceStub(channel)
            for session in (0, 12345):
                header = ps_pb2.PushHeader(
                    rank=0, incarnation=1, clock=0, plan_digest=shard.plan.digest, session=session
                )
                started = time.monotonic()
                call = stub.PushPull(
                    stalled.requests([ps_pb2.PushPullRequest(header=header)]), timeout=CALL_TIMEOUT, metadata=WORKER
                )
                with pytest.raises(grpc.RpcError) as err:
                    list(call)
                assert time.monotonic() - started < 5
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
                assert reason_of(err.value) == "NOT_JOINED"
        wait_until(lambda: server.waiting.open == 0, 5, "the refused calls' slots")


def test_a_rank_holding_its_whole_share_does_not_stop_another_ranks_training(start_cluster, wait_until) -> None:
    """Rank tokens: rank 1's token opens as many waiting calls as the whole shared cap (InitTables
    of rank 1 before rank 0 declared any table: each waits). Rank 1 gets its share, the rest are
    refused TOO_MANY_WAITS, and rank 0 (async) trains on with a short retry deadline."""
    tokens = {0: "rank-zero-token-0123456789", 1: "rank-one-token-0123456789"}
    (server,) = start_cluster(
        1, num_workers=2, mode="async", admin_token="admin-secret", rank_tokens=RankTokens(tokens), lease_timeout=30
    )
    share = rank_share(server.waiting.limit, 2)
    assert server.waiting.rank_share == share < server.waiting.limit
    as_one = (("authorization", f"Bearer {tokens[1]}"),)
    model = small_model()
    with PSClient([server.address], rank=0, num_workers=2, timeout=10, retry_deadline=3, token=tokens[0]) as c0:
        c0.init(model, {"name": "sgd", "lr": 0.1}, init_timeout=20)
        with grpc.insecure_channel(server.address) as channel:
            stub = ps_pb2_grpc.ParameterServiceStub(channel)
            spec = table_spec_to_proto(TableSpec("emb", 100, 4, RowOptimizerSpec("sgd", {"lr": 0.1})))
            request = ps_pb2.InitTablesRequest(rank=1, incarnation=1, tables=[spec])
            calls = [
                stub.InitTables.future(request, timeout=CALL_TIMEOUT, metadata=as_one)
                for _ in range(server.waiting.limit)
            ]
            try:
                wait_until(lambda: server.waiting.by_rank.get(1) == share, 10, "rank 1's share to be held")
                refused = wait_until(
                    lambda: (
                        [c for c in calls if c.done()] if sum(c.done() for c in calls) == len(calls) - share else None
                    ),
                    10,
                    "the calls beyond rank 1's share to be refused",
                )
                for call in refused:
                    assert call.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert reason_of(call.exception()) == "TOO_MANY_WAITS"
                    assert "Rank 1 already holds its share" in call.exception().details()
                params = {k: p.data for k, p in model.named_parameters()}
                for _ in range(5):
                    c0.push_pull({k: torch.ones_like(p) for k, p in model.named_parameters()}, params)
                assert server.shard.members[0].pushes == 5
                assert server.waiting.by_rank.get(1) == share  # still held all along
            finally:
                for call in calls:
                    call.cancel()
        wait_until(lambda: server.waiting.open == 0, 10, "the cancelled calls' slots")
