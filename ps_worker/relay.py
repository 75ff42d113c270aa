"""The worker's side of the membership epochs (``ps_server.membership.epochs``): shard 0 decides, workers relay.

:class:`EpochRelay` keeps the newest ``ps.v1.MembershipEpoch`` record a worker has seen and the epoch
each shard last reported, says what a request to a shard carries (the record only for a shard that
is behind), adopts newer records from answers (a resize reaches its ``resized`` callback), and wakes
the heartbeat thread to hand a record to a shard behind at once. A
:class:`~ps_worker.session.Session` holds one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ps_proto.v1 import ps_pb2

if TYPE_CHECKING:
    from ps_worker.consistency import WorkerMode


class EpochRelay:
    """Membership records as one worker knows them.

    Args:
        num_shards: shards in the cluster.
        resized: called (outside the lock) with a newer record that changes the worker count.

    Attributes:
        membership: the newest record (epoch 0: no decision seen yet).
        shard_epochs: per shard, the epoch it last reported.
        wake: set when a shard knows an older epoch than this worker (the heartbeat thread waits on it).
    """

    def __init__(self, num_shards: int, resized: Callable[[ps_pb2.MembershipEpoch], None]) -> None:
        self.membership = ps_pb2.MembershipEpoch()
        self.shard_epochs = [0] * num_shards
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self._resized = resized

    def relayed(self, k: int) -> tuple[int, ps_pb2.MembershipEpoch | None]:
        """What a request to shard ``k`` carries: the epoch this worker knows, and the record
        itself when shard ``k`` last reported an older one."""
        with self._lock:
            record = self.membership
            return record.epoch, (record if self.shard_epochs[k] < record.epoch else None)

    def learn(self, k: int, answer: object) -> None:
        """Note the membership epoch shard ``k`` answered with, and adopt the record it carries
        when newer (a resize reaches ``resized``); wake the heartbeat thread when a shard knows an
        older epoch than this worker (it relays the record at once)."""
        epoch = int(getattr(answer, "membership_epoch", 0))
        record = answer.membership if answer.HasField("membership") else None  # type: ignore[attr-defined]
        resized = None
        with self._lock:
            if record is not None and record.epoch > self.membership.epoch:
                if record.num_workers and record.num_workers != self.membership.num_workers:
                    resized = record
                self.membership = record
            self.shard_epochs[k] = max(epoch, record.epoch if record is not None else 0)
            behind = min(self.shard_epochs) < self.membership.epoch
        if resized is not None:
            self._resized(resized)
        if behind:
            self.wake.set()

    def in_cluster(self, rank: int, clock: int, mode: WorkerMode) -> bool:
        """Whether ``rank`` pushes step ``clock``: a resize to fewer workers ends ranks beyond the
        new count at its version (sync: its round; other modes: at once)."""
        record = self.membership
        if not record.epoch or rank < record.num_workers:
            return True
        return mode.resize_pending(clock, record.resize_version) and rank < record.previous_num_workers
