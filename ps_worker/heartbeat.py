"""A worker's heartbeat thread: keeps its lease at shard 0 and relays membership records to every shard.

A Heartbeat goes to every shard each third of the lease (shard 0 renews the lease; every shard gets
the membership record it lacks, :class:`~ps_worker.relay.EpochRelay`), and at once to the shards
behind when the relay wakes the thread.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from ps_proto.v1 import ps_pb2
from ps_worker.redo import RedoLog
from ps_worker.relay import EpochRelay
from ps_worker.transport.grpc_link import LEAVE_SECONDS, Transport

log = logging.getLogger(__name__)


class Heartbeat:
    """The heartbeat thread of one worker session (started once, stopped once).

    Args:
        transport: the session's links to the shards (its stubs, metadata, data ports).
        rank, incarnation: what each Heartbeat carries (the session's, fixed for its life).
        epochs: the membership records each Heartbeat relays, and learns from the answers.
        redo_log: learns each shard's newest checkpoint from its answer.

    Attributes:
        thread: the thread, once started (None before).
    """

    def __init__(
        self, transport: Transport, rank: int, incarnation: int, epochs: EpochRelay, redo_log: RedoLog
    ) -> None:
        self.transport, self.rank, self.incarnation = transport, rank, incarnation
        self.epochs, self.redo_log = epochs, redo_log
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self, lease_timeout: float) -> None:
        """Start the thread, a beat each third of ``lease_timeout`` (seconds: the cluster's, told at
        Join), unless it already runs."""
        if self.thread is None:
            name = f"ps-heartbeat-{self.rank}"
            self.thread = threading.Thread(target=self._beat, args=(lease_timeout / 3,), name=name, daemon=True)
            self.thread.start()

    def stop(self, wait: bool = True) -> None:
        """Stop the thread; ``wait``: join it (at most :data:`LEAVE_SECONDS`)."""
        self._stop.set()
        self.epochs.wake.set()
        if wait and self.thread is not None:
            self.thread.join(timeout=LEAVE_SECONDS)

    def _beat(self, period: float) -> None:
        t, epochs = self.transport, self.epochs
        due = time.monotonic() + period
        while not self._stop.is_set():
            relay = epochs.wake.wait(max(0.0, due - time.monotonic()))
            epochs.wake.clear()
            if self._stop.is_set():
                return
            full = not relay or time.monotonic() >= due
            if full:
                due = time.monotonic() + period
            for k, stub in enumerate(t.stubs):
                epoch, record = epochs.relayed(k)
                if not full and record is None:
                    continue  # a relay round: only the shards behind
                req = ps_pb2.HeartbeatRequest(
                    rank=self.rank, incarnation=self.incarnation, membership_epoch=epoch, membership=record
                )
                try:
                    answer = stub.Heartbeat(req, timeout=max(1.0, period), metadata=t.metadata)
                    epochs.learn(k, answer)
                    self.redo_log.learn(k, answer)
                    t.offer_data_port(k, answer.data_port, joined=False)
                except grpc.RpcError as exc:
                    log.debug("heartbeat to %s failed: %s", t.servers[k], exc.code())
