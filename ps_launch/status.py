"""The shards' status as ps-launch reads it (``Admin/GetStatus``, ``Admin/Resize`` on shard 0) and
the membership changes it shows on the console; moved out of :mod:`ps_launch.cluster`, which starts
and stops the processes."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import grpc

from ps_common.flags import secret
from ps_proto.v1 import ps_pb2, ps_pb2_grpc


def _admin_metadata() -> tuple[tuple[str, str], ...]:
    try:
        token = secret(os.environ.get("PS_ADMIN_TOKEN", ""), os.environ.get("PS_ADMIN_TOKEN_FILE", ""), "--admin-token")
    except ValueError:
        token = ""
    return (("authorization", f"Bearer {token}"),) if token else ()


def resize_job(address: str, num_workers: int, timeout: float = 10.0) -> ps_pb2.ResizeResponse:
    """Admin/Resize on shard 0 (``address``): the job has ``num_workers`` ranks from its next round."""
    with grpc.insecure_channel(address) as channel:
        stub = ps_pb2_grpc.AdminStub(channel)
        return stub.Resize(ps_pb2.ResizeRequest(num_workers=num_workers), timeout=timeout, metadata=_admin_metadata())


def shard_statuses(addresses: Sequence[str], timeout: float = 10.0) -> list[ps_pb2.ShardStatus]:
    """Admin/GetStatus of every shard (the shards' own account of clocks and refusals), with the admin
    token the shards took from this environment (``PS_ADMIN_TOKEN`` or ``PS_ADMIN_TOKEN_FILE``), if any."""
    metadata = _admin_metadata()
    statuses = []
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            stub = ps_pb2_grpc.AdminStub(channel)
            statuses.append(stub.GetStatus(ps_pb2.GetStatusRequest(), timeout=timeout, metadata=metadata).status)
    return statuses


class MembershipWatch:
    """Polls one shard's status and says when a rank's state or incarnation changes (an eviction, a
    rejoin), so a fault injection shows its consequences on the console. ``clocks`` keeps each rank's
    (clock, incarnation) as last seen: the progress of a user's script, which prints no step events."""

    def __init__(self, address: str, interval: float = 0.5) -> None:
        self.address = address
        self.interval = interval
        self.seen: dict[int, tuple[int, int]] = {}
        self.clocks: dict[int, tuple[int, int]] = {}
        self.next = 0.0

    def changes(self) -> list[str]:
        now = time.monotonic()
        if now < self.next:
            return []
        self.next = now + self.interval
        try:
            (status,) = shard_statuses([self.address], timeout=2.0)
        except grpc.RpcError:
            return []
        lines = []
        for w in status.workers:
            before = self.seen.get(w.rank)
            self.seen[w.rank] = (w.state, w.incarnation)
            if w.state == ps_pb2.WORKER_STATE_LIVE:
                self.clocks[w.rank] = (w.clock, w.incarnation)
            if before is None or before == (w.state, w.incarnation) or before[0] == ps_pb2.WORKER_STATE_PENDING:
                continue  # nothing new, or a first join
            state = ps_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower()
            if w.state == ps_pb2.WORKER_STATE_EVICTED:
                lines.append(
                    f"shard-0 evicted rank {w.rank} at clock {w.clock} (its lease lapsed); rounds go on without it"
                )
            elif w.incarnation != before[1] and w.state == ps_pb2.WORKER_STATE_LIVE:
                lines.append(f"shard-0 counts rank {w.rank} again (new incarnation {w.incarnation}, clock {w.clock})")
            elif w.state != ps_pb2.WORKER_STATE_LEFT:
                lines.append(f"rank {w.rank} is {state} on shard-0 (clock {w.clock})")
        return lines
