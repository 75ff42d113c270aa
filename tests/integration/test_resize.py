"""Resizes of a running sync job with real shards and training ranks: a later resize supersedes one
still pending, so no round waits for a rank that only the superseded resize added."""

from __future__ import annotations

import grpc
import pytest

from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from tests.conftest import RPC_TIMEOUT


def versions(stubs: list[ps_pb2_grpc.AdminStub]) -> list[int]:
    return [s.GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT).status.version for s in stubs]


@pytest.mark.parametrize("sizes", [[3, 2], [3, 5, 1, 4, 2, 6, 3] * 7 + [2]], ids=["3-then-2", "50-rapid"])
def test_resizes_before_the_next_round_leave_training_going(start_cluster, start_trainer, wait_until, sizes) -> None:
    shards = start_cluster(2, num_workers=2, mode="sync")
    trainers = [start_trainer(shards.addresses, rank=r, num_workers=2, pace=0.01) for r in (0, 1)]
    channels = [grpc.insecure_channel(a) for a in shards.addresses]
    try:
        admin = [ps_pb2_grpc.AdminStub(c) for c in channels]
        wait_until(lambda: min(versions(admin)) >= 3, 60, "training started")
        for n in sizes:  # back to back: all of them before the next round, or nearly
            admin[0].Resize(ps_pb2.ResizeRequest(num_workers=n), timeout=RPC_TIMEOUT)
        # before: the open round waited for a rank 2 that never started (0 steps/s)
        start = max(versions(admin))
        wait_until(lambda: min(versions(admin)) >= start + 10, 60, "training going on after the resizes")
        statuses = [s.GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT).status for s in admin]
        assert [s.config.num_workers for s in statuses] == [2, 2]
        assert all(set(s.round_waiting_for) <= {0, 1} for s in statuses)
        assert all(t.error is None for t in trainers), [t.error for t in trainers]
    finally:
        for c in channels:
            c.close()
