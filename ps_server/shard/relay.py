"""The membership record relay of a shard (:class:`MembershipRelay`): each membership request as one
call, with the record of shard 0 it carries followed and the record its answer tells.

Workers relay shard 0's membership records (:mod:`ps_server.membership.epochs`) to the other shards:
a request carries the newest record its worker knows, and an answer tells the requester the shard's
record when the requester knows an older one.
"""

from __future__ import annotations

import dataclasses
import threading

from ps_proto.v1 import ps_pb2
from ps_server.membership.ranks import WorkerState
from ps_server.shard.members import MembersHost, ShardMembers
from ps_server.shard.views import JoinInfo


class MembershipRelay:
    """Join, Heartbeat, Leave and Resize requests of one shard, over its :class:`ShardMembers`.

    Every method takes the shard's lock ``cond`` (the servicers call them through the shard).

    Args:
        host: the shard (its settings and learning rate, for a Join's answer).
        members: the shard's membership glue.
        cond: the shard's condition (its lock).
    """

    def __init__(self, host: MembersHost, members: ShardMembers, cond: threading.Condition) -> None:
        self._host, self._members, self._cond = host, members, cond

    def join_relaying(
        self, rank: int, num_workers: int, incarnation: int, epoch: int, record: ps_pb2.MembershipEpoch | None
    ) -> JoinInfo:
        """A Join request: :meth:`join`, and the membership record it relays (``record``, None if
        none) followed. The one request whose record is followed before its own checks: a rank
        counted again, or one a resize added, is known here only from shard 0's record, which its
        join carries. The record is checked first (signed by shard 0, of this shard's cluster), so
        only a genuine decision of this cluster, which every shard follows anyway, is ever adopted
        from it. A shard that knows no cluster yet (no ``--cluster-id``, no record followed)
        follows the record only once the Join itself was accepted: it pins that record's cluster.

        Returns:
            :meth:`join`'s answer with the record the shard follows, its settings and learning rate.

        Raises:
            As :meth:`join` and :meth:`adopt`.
        """
        with self._cond:
            shard = self._host
            pinned = bool(self._members.epochs.cluster_id)
            if pinned and record is not None:
                self._members.adopt(record)
            info = self._members.join(rank, num_workers, incarnation, epoch)
            if not pinned and record is not None:
                self._members.adopt(record)
            return dataclasses.replace(
                info,
                membership=self._members.epochs.record,
                settings=shard.settings,
                learning_rate=shard.learning_rate(),
            )

    def heartbeat_relaying(
        self, rank: int, incarnation: int, record: ps_pb2.MembershipEpoch | None, request_epoch: int
    ) -> tuple[int, WorkerState, int, ps_pb2.MembershipEpoch | None]:
        """A Heartbeat request: its checks, the record it relays followed (only from a rank live here
        under ``incarnation``), :meth:`heartbeat`. Returns (version, state, :meth:`told`)."""
        with self._cond:
            self._members.check_member(rank, incarnation)  # a refused heartbeat adopts nothing
            if record is not None and self._members.is_live(rank, incarnation):  # nor one of a rank not joined as this
                self._members.adopt(record)
            version, state = self._members.heartbeat(rank, incarnation)
            return (version, state, *self.told(request_epoch))

    def leave_relaying(
        self, rank: int, incarnation: int, session: int, record: ps_pb2.MembershipEpoch | None, request_epoch: int
    ) -> tuple[int, int, ps_pb2.MembershipEpoch | None]:
        """A Leave request: its checks (a live rank leaves only with its own session), the record it
        relays followed, :meth:`leave`. Returns (version, :meth:`told`)."""
        with self._cond:
            self._members.check_member(rank, incarnation)
            if self._members.is_live(rank, incarnation):  # only its own session ends a live rank
                self._members.check_session(rank, incarnation, session, "Leave")
                if record is not None:
                    self._members.adopt(record)
            version = self._members.leave(rank, incarnation)
            return (version, *self.told(request_epoch))

    def resize_request(self, num_workers: int, at_version: int | None) -> tuple[int, int, int, int]:
        """A Resize request: :meth:`resize`; returns (previous count, the version it holds from,
        the count in force, the membership epoch)."""
        with self._cond:
            previous, at = self._members.resize(num_workers, at_version)
            return previous, at, self._members.membership.num_workers, self._members.epochs.epoch

    def told(self, request_epoch: int) -> tuple[int, ps_pb2.MembershipEpoch | None]:
        """What an answer tells: the shard's membership epoch, and its record when the requester
        knows an older one (``request_epoch``; the worker relays it to the shards behind)."""
        with self._cond:
            return self._members.epochs.epoch, self._members.epochs.for_request(request_epoch)
