"""Membership epochs: one authority (shard 0) decides who the cluster counts, every shard follows.

Each shard keeps its own leases and clocks (:mod:`ps_server.membership.ranks`), but only shard 0 decides
whether a rank *counts* in rounds and waits: an eviction after a lapsed lease, a Leave, an
operator's EvictWorker, a rejoin after either, a worker-count change (Resize) and a configuration
change (UpdateConfig) are each one decision there, stamped with the next **membership epoch**. The
decision travels as a ``ps.v1.MembershipEpoch`` record: every answer of a shard carries the epoch it
knows (the record itself when the request carried an older epoch), workers keep the newest record
and hand it to any shard that reported an older epoch — on its next request or, at once, on a
heartbeat. Higher epochs win; a shard that adopts one applies it to its own members:

- a rank the record stops counting (evicted, left) is no longer waited for, and its local state
  follows, so its pushes are refused until it joins again (shard 0 first, which decides that);
- a rank the record counts again is waited for from the shard's open round on;
- a worker-count change holds from the record's ``resize_version`` (sync: the same round on every
  shard, because no rank can push that round anywhere before shard 0 answered it the round before,
  with the record); ranks beyond the new count push no round from there on;
- configuration changes are applied when the shard's version reaches each one's version.

So no shard ever stops waiting for a rank that another shard still counts, which is how the shards
of a sync job used to count rounds differently after an eviction (and, in the worst case, wait on
each other until their deadline). Shard 0's loss stops the job anyway (its partitions are
unavailable); it resumes from its checkpoint, and its first decision after a start takes an epoch
above any it could have made before (the start time in seconds, shifted by :data:`COUNTER_BITS`),
while the records workers hand it bring it the decisions its checkpoint missed.

Records are bound to their cluster: shard 0 picks a random **cluster id** at its first start (or
takes ``--cluster-id``), keeps it in its checkpoints and puts it in every record, inside the
signed bytes. Another shard pins the id of the first record it follows (or ``--cluster-id``), keeps
it in its checkpoints too, and refuses any record of another cluster: a record of an earlier job
whose shards had the same admin token is not followed. Shard 0 makes its first decision at its first
Join ("cluster formed"), so that the cluster's own record reaches the other shards with the first
worker's joins, before a record of another cluster could be relayed to them by anyone else.

Pure bookkeeping over a :class:`~ps_server.membership.ranks.Membership`; the shard holds the lock.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

from ps_common.errors import InvalidRequestError
from ps_proto.v1 import ps_pb2
from ps_server.membership.ranks import Member, Membership, WorkerState

COUNTER_BITS = 20
"""Decisions one authority process can make before its epochs reach the next second's floor."""

KEPT_CHANGES = 16
"""Configuration changes a record keeps (the newest): a shard further behind applies the rest only
from the checkpointed settings."""

MAX_WORKERS = 1 << 16
"""Most workers a record may name: a relayed record is checked against it before anything is built."""

_STATE_TO_PROTO = {
    WorkerState.PENDING: ps_pb2.WORKER_STATE_PENDING,
    WorkerState.LIVE: ps_pb2.WORKER_STATE_LIVE,
    WorkerState.EVICTED: ps_pb2.WORKER_STATE_EVICTED,
    WorkerState.LEFT: ps_pb2.WORKER_STATE_LEFT,
}
_STATE_FROM_PROTO = {v: k for k, v in _STATE_TO_PROTO.items()}


def _decided(member: Member) -> WorkerState:
    """The state a record gives ``member``: LIVE or PENDING (not joined here yet) when the cluster
    counts it, EVICTED or LEFT when not."""
    active = member.state in (WorkerState.PENDING, WorkerState.LIVE)
    if member.counted == active:
        return member.state
    return WorkerState.PENDING if member.counted else WorkerState.EVICTED


class Epochs:
    """The membership record a shard follows (and, on shard 0, makes).

    Args:
        authority: True on shard 0, which decides; other shards only adopt.
        num_workers: the worker count before any decision.
        wall: seconds since the Unix epoch (injected for tests): the floor of a new authority's epochs.
        key: the key records are signed and checked with (the shards' admin token; "": none).
        cluster_id: the cluster's id when the operator gives one (``--cluster-id``, the same on every
            shard); "": shard 0 picks a random one, another shard pins the first record's.

    Attributes:
        record: the newest ``ps.v1.MembershipEpoch`` this shard knows (epoch 0: no decision yet).
        applied: configuration changes applied here, each with the version it was applied at.
        applied_epoch: the scheduling epoch of the newest change applied here.
        cluster_id: the cluster this shard follows records of ("" on another shard before its first).
    """

    def __init__(
        self,
        authority: bool,
        num_workers: int,
        wall: Callable[[], float] = time.time,
        key: str = "",
        cluster_id: str = "",
    ) -> None:
        self.authority = authority
        self.wall = wall
        self.key = key.encode()
        self.configured = num_workers  # the shards' --num-workers
        self.given_cluster_id = cluster_id  # --cluster-id: never replaced by a checkpoint's or a record's
        self.cluster_id = cluster_id or (secrets.token_hex(16) if authority else "")
        self.record = ps_pb2.MembershipEpoch(
            num_workers=num_workers,
            previous_num_workers=num_workers,
            configured_num_workers=num_workers,
            cluster_id=self.cluster_id,
        )
        self.applied: list[ps_pb2.ConfigChange] = []
        self.applied_epoch = 0
        self._started = False  # no decision made by this process yet

    @property
    def epoch(self) -> int:
        return int(self.record.epoch)

    # ------------------------------------------------------------------ shard 0
    def decide(self, membership: Membership, version: int, reason: str) -> ps_pb2.MembershipEpoch:
        """Stamp ``membership`` as it is now with the next epoch (shard 0 only).

        Args:
            membership: the shard's members after the decision.
            version: the shard's version now.
            reason: what was decided, in words (logged and shown in GetStatus).

        Returns:
            The new record.
        """
        assert self.authority, "only shard 0 decides membership"
        epoch = self.epoch + 1
        if not self._started:  # above anything a previous process of shard 0 decided
            epoch = max(epoch, int(self.wall()) << COUNTER_BITS)
            self._started = True
        record = ps_pb2.MembershipEpoch(
            epoch=epoch,
            cluster_id=self.cluster_id,
            configured_num_workers=self.configured,
            decided_at_version=version,
            num_workers=membership.num_workers,
            previous_num_workers=membership.previous_num_workers,
            resize_version=membership.resize_version,
            reason=reason[:200],
            members=[
                ps_pb2.EpochMember(
                    rank=m.rank,
                    state=_STATE_TO_PROTO[_decided(m)],
                    incarnation=m.incarnation,
                    since_version=m.since,
                    until_version=m.until,
                )
                for m in membership.members
            ],
        )
        record.config_changes.extend(self.record.config_changes)
        self.record = self.signed(record)
        return self.record

    def schedule(self, membership: Membership, version: int, change: ps_pb2.ConfigChange, reason: str) -> None:
        """Decide a configuration change at ``change.version`` (shard 0 only); the record keeps
        the newest :data:`KEPT_CHANGES`."""
        record = self.decide(membership, version, reason)
        change.epoch = record.epoch
        record.config_changes.append(change)
        del record.config_changes[: max(0, len(record.config_changes) - KEPT_CHANGES)]
        self.record = self.signed(record)

    # ------------------------------------------------------------------ trust
    def _mac(self, record: ps_pb2.MembershipEpoch) -> bytes:
        unsigned = ps_pb2.MembershipEpoch()
        unsigned.CopyFrom(record)
        unsigned.ClearField("signature")
        return hmac.new(self.key, unsigned.SerializeToString(deterministic=True), hashlib.sha256).digest()

    def signed(self, record: ps_pb2.MembershipEpoch) -> ps_pb2.MembershipEpoch:
        """``record`` with its signature (none without a key)."""
        record.signature = self._mac(record) if self.key else b""
        return record

    def check(self, record: ps_pb2.MembershipEpoch) -> None:
        """Refuse a relayed record this shard must not follow, before it changes anything.

        Raises:
            InvalidRequestError: the shards have a key (admin token) and the record's signature does
                not match (a forged or altered record); the record belongs to another cluster than
                the one this shard follows (an earlier job's, with the same admin token); or a record
                beyond the bounds (more than :data:`MAX_WORKERS` workers or members,
                :data:`KEPT_CHANGES` changes, ranks out of order).
        """
        if self.key and not hmac.compare_digest(record.signature, self._mac(record)):
            raise InvalidRequestError(
                "The membership record is not signed by shard 0 (a forged or altered record); it is ignored."
            )
        n = len(record.members)
        if not 1 <= record.num_workers <= MAX_WORKERS or n > MAX_WORKERS or len(record.config_changes) > KEPT_CHANGES:
            raise InvalidRequestError(
                f"The membership record names {record.num_workers} workers, {n} members and "
                f"{len(record.config_changes)} changes; at most {MAX_WORKERS}, {MAX_WORKERS} and {KEPT_CHANGES}."
            )
        if any(m.rank != r for r, m in enumerate(record.members)):
            raise InvalidRequestError("The membership record's members are not ranks 0, 1, 2, ... in order.")
        if self.cluster_id and record.cluster_id != self.cluster_id:
            raise InvalidRequestError(
                f"The membership record belongs to cluster {record.cluster_id[:32]!r}, not to this shard's cluster "
                f"{self.cluster_id!r} (a record of another job whose shards have the same admin token); it is "
                "ignored. Give each job its own admin token, or its own --cluster-id."
            )
        if not record.cluster_id:
            raise InvalidRequestError("The membership record names no cluster (cluster_id); it is ignored.")

    # ------------------------------------------------------------------ every shard
    def adopt(self, record: ps_pb2.MembershipEpoch, membership: Membership) -> bool:
        """Follow ``record`` when it is newer than the one held: apply its worker count and which
        ranks count to ``membership``. Returns whether it was adopted.

        A rank the record does not count (evicted, left) under an incarnation at least the local
        one is marked so here too (its pushes are refused until it joins again); a rank it counts
        is waited for.
        """
        if record.epoch <= self.epoch:
            return False
        if not self.cluster_id:  # the first record this shard follows: its cluster from now on
            self.cluster_id = record.cluster_id
        if record.num_workers and record.num_workers != membership.num_workers:
            membership.resize(record.num_workers, record.resize_version)
        for entry in record.members:
            if entry.rank >= len(membership.members):
                continue
            m = membership.members[entry.rank]
            state = _STATE_FROM_PROTO.get(entry.state, WorkerState.PENDING)
            counted = state in (WorkerState.PENDING, WorkerState.LIVE)
            if (
                not counted
                and entry.incarnation >= m.incarnation
                and m.state in (WorkerState.LIVE, WorkerState.PENDING)
            ):
                m.state = state
            m.counted = counted
            m.since = int(entry.since_version)
            if entry.until_version != m.until:  # the pushes of the incarnation decided about
                m.until, m.until_incarnation = int(entry.until_version), int(entry.incarnation)
        self.record = record
        return True

    def due(self, version: int) -> list[ps_pb2.ConfigChange]:
        """Changes not yet applied here whose version ``version`` has reached, oldest first; each
        is marked applied (at ``version``)."""
        out = []
        for change in self.record.config_changes:
            if change.epoch > self.applied_epoch and change.version <= version:
                self.applied_epoch = change.epoch
                applied = ps_pb2.ConfigChange()
                applied.CopyFrom(change)
                applied.version = version
                self.applied.append(applied)
                del self.applied[: max(0, len(self.applied) - KEPT_CHANGES)]
                out.append(change)
        return out

    def pending(self) -> list[ps_pb2.ConfigChange]:
        """Scheduled changes not yet applied here."""
        return [c for c in self.record.config_changes if c.epoch > self.applied_epoch]

    def for_request(self, request_epoch: int) -> ps_pb2.MembershipEpoch | None:
        """The record to put in an answer to a request that carried ``request_epoch``: this
        shard's when the requester knows an older one, else None."""
        return self.record if request_epoch < self.epoch else None

    # ------------------------------------------------------------------ checkpoints
    def export(self) -> dict[str, object]:
        return {
            "cluster_id": self.cluster_id,
            "record": self.record.SerializeToString(),
            "applied_epoch": self.applied_epoch,
            "applied": [c.SerializeToString() for c in self.applied],
        }

    def restore(self, saved: dict[str, object] | None) -> None:
        """The record and applied changes of :meth:`export` (checkpoints written before epochs: none)."""
        if not saved:
            return
        record = ps_pb2.MembershipEpoch.FromString(bytes(saved["record"]))  # type: ignore[arg-type]
        self.record = record
        # the checkpoint's cluster (records it followed are of it); --cluster-id, when given, wins
        saved_id = str(saved.get("cluster_id", "") or record.cluster_id)
        if not self.given_cluster_id and saved_id:
            self.cluster_id = saved_id
        if self.authority and not record.cluster_id:  # a checkpoint of a release before cluster ids
            record.cluster_id = self.cluster_id
            self.record = self.signed(record)
        self.applied_epoch = int(saved.get("applied_epoch", 0))  # type: ignore[call-overload]
        self.applied = [ps_pb2.ConfigChange.FromString(bytes(b)) for b in saved.get("applied", [])]  # type: ignore[attr-defined]
