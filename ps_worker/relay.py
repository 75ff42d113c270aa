"""The worker's side of the membership epochs (``ps_server.membership.epochs``): shard 0 decides, workers relay.

:class:`EpochRelay` keeps the newest ``ps.v1.MembershipEpoch`` record a worker has seen and the epoch
each shard last reported, says what a request to a shard carries (the record only for a shard that
is behind), adopts newer records from answers (a resize reaches ``on_resize``), and wakes the
heartbeat thread to hand a record to a shard behind at once. :class:`~ps_worker.session.Session`
is one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ps_proto.v1 import ps_pb2

log = logging.getLogger("ps_worker.session")


class EpochRelay:
    """Membership records as one worker knows them.

    Args:
        num_shards: shards in the cluster.

    Attributes (also set by the session): ``rank``, ``num_workers``, ``mode``.
        membership: the newest record (epoch 0: no decision seen yet).
        shard_epochs: per shard, the epoch it last reported.
        on_resize: called with a record that changes the worker count.
    """

    rank: int
    num_workers: int
    mode: str

    def __init__(self, num_shards: int) -> None:
        self.membership = ps_pb2.MembershipEpoch()
        self.shard_epochs = [0] * num_shards
        self._relay = threading.Event()
        self._epoch_lock = threading.Lock()
        self.on_resize: Callable[[ps_pb2.MembershipEpoch], None] | None = None

    def relayed(self, k: int) -> tuple[int, ps_pb2.MembershipEpoch | None]:
        """What a request to shard ``k`` carries: the epoch this worker knows, and the record
        itself when shard ``k`` last reported an older one."""
        with self._epoch_lock:
            record = self.membership
            return record.epoch, (record if self.shard_epochs[k] < record.epoch else None)

    def learn(self, k: int, answer: object) -> None:
        """Note the membership epoch shard ``k`` answered with, and adopt the record it carries
        when newer (a resize reaches :attr:`on_resize`); wake the heartbeat thread when a shard
        knows an older epoch than this worker (it relays the record at once)."""
        epoch = int(getattr(answer, "membership_epoch", 0))
        record = answer.membership if answer.HasField("membership") else None  # type: ignore[attr-defined]
        resized = None
        with self._epoch_lock:
            if record is not None and record.epoch > self.membership.epoch:
                if record.num_workers and record.num_workers != self.membership.num_workers:
                    resized = record
                self.membership = record
            self.shard_epochs[k] = max(epoch, record.epoch if record is not None else 0)
            behind = any(e < self.membership.epoch for e in self.shard_epochs)
        if resized is not None:
            self._resized(resized)
        if behind:
            self._relay.set()

    def _resized(self, record: ps_pb2.MembershipEpoch) -> None:
        previous, self.num_workers = self.num_workers, int(record.num_workers)
        if previous != self.num_workers:
            log.info(
                "rank %d: the cluster has %d workers from version %d on (was %d; membership epoch %d)",
                self.rank,
                self.num_workers,
                record.resize_version,
                previous,
                record.epoch,
            )
        if self.on_resize is not None:
            self.on_resize(record)

    def in_cluster(self, clock: int) -> bool:
        """Whether this rank pushes step ``clock``: a resize to fewer workers ends ranks beyond the
        new count at its version (sync: round; other modes: at once)."""
        record = self.membership
        if not record.epoch or self.rank < record.num_workers:
            return True
        return self.mode == "sync" and clock < record.resize_version and self.rank < record.previous_num_workers
