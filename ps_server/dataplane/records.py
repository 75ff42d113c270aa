"""Reading the records of a shard's data connection: push frames' partitions, each checked against
the plan before its bytes are read, and calls (:class:`~ps_server.dataplane.calls.CallServer`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ps_common import dataconn
from ps_common.codec import check_finite, decode, dtype_from_proto
from ps_common.errors import InvalidRequestError, PSError
from ps_common.partition import WirePartition
from ps_common.plan import PartitionSlice, Plan
from ps_server.core.partitions import check_dense_bytes, check_dtype
from ps_server.dataplane.calls import CallServer
from ps_server.dataplane.connection import Connection
from ps_server.dataplane.parked import Parking
from ps_server.dataplane.refusals import Refusals


class FrameReader:
    """Reads the records of one shard's data connections, each on its connection's thread.

    Args:
        shard_index: this shard.
        plan_of: the shard's plan now (None before Init).
        parking: where frames being read and complete frames are parked.
        calls: runs the calls that come on a connection.
        member: called with (rank, incarnation) at each push frame's first record; raises a
            PSError when the rank is not a live member under that incarnation.
        admit: whether (rank, incarnation, session) is the rank's current session on the shard.
        refusals: where frames refused (not a live member, not the current session) are counted.
        landed: called (holding no lock of the plane's) each time a push partition lands.
        counted: called with (bytes received, 0) as each push frame completes.
    """

    def __init__(
        self,
        shard_index: int,
        plan_of: Callable[[], Plan | None],
        parking: Parking,
        calls: CallServer,
        member: Callable[[int, int], None],
        admit: Callable[[int, int, int], bool],
        refusals: Refusals,
        landed: Callable[[], None],
        counted: Callable[[int, int], None],
    ) -> None:
        self.shard_index = shard_index
        self._plan_of = plan_of
        self._parking = parking
        self._calls = calls
        self._member = member
        self._admit = admit
        self._refusals = refusals
        self._landed = landed
        self._counted = counted

    def read(self, conn: Connection) -> None:
        """Read push frames and calls until the connection closes; each record is checked against
        the plan before its bytes are read, and a complete frame replaces the one waiting (if any).

        Raises:
            InvalidRequestError: a record out of order, not the plan's, or from a rank that may not
                push now (the connection closes).
            OSError, DataConnectionError: the connection broke.
        """
        sock = conn.sock
        sequence: int | None = None
        parts: dict[int, WirePartition] = {}
        received = 0
        while True:
            seq, slot, dtype_code, nbytes = dataconn.recv_struct(sock, dataconn.RECORD)
            if slot == dataconn.CALL:
                if sequence is not None:
                    raise InvalidRequestError(f"call {seq} began before frame {sequence} ended")
                self._calls.serve(conn, seq, dtype_code, nbytes)
                continue
            if sequence is not None and seq != sequence:
                raise InvalidRequestError(f"frame {seq} began before frame {sequence} ended")
            if sequence is None:
                self._check_member(conn, seq)
                if not self._admit(conn.rank, conn.incarnation, conn.session):
                    self._refusals.refuse(
                        "data connection of rank %d closed at frame %d: not its current session", conn.rank, seq
                    )
                    raise InvalidRequestError(
                        f"frame {seq}: the hello's session is not rank {conn.rank}'s current one (join again)"
                    )
            sequence = seq
            if slot == dataconn.END:
                if nbytes != len(parts):
                    raise InvalidRequestError(f"frame {seq} ended after {len(parts)} partitions, not {nbytes}")
                self._parking.complete(conn, seq, parts)
                self._landed()
                self._counted(received, 0)
                sequence, parts, received = None, {}, 0
                continue
            owned = self._owned()
            if slot >= len(owned) or slot in parts:
                raise InvalidRequestError(f"frame {seq}: slot {slot} is not one of {len(owned)} or came twice")
            part = owned[slot]
            name = dtype_from_proto(dtype_code)
            self._check_record(seq, part, name, nbytes)
            self._parking.park(conn, seq, nbytes)
            view = dataconn.byte_view(torch.empty(nbytes, dtype=torch.uint8))
            dataconn.recv_exact(sock, view)
            # checked here, while the frame's later partitions are still arriving; a partition that
            # is not finite goes on unmarked, and the PushPull's Intake refuses it with its message
            try:
                bound = check_finite(decode(view, name, part.length), "")
                finite = True
            except InvalidRequestError:
                finite, bound = False, math.inf
            parts[slot] = WirePartition(part.key, part.offset, part.length, name, view, finite=finite, bound=bound)
            received += nbytes + dataconn.RECORD.size
            self._parking.landed(conn, seq, parts)
            self._landed()

    def _check_record(self, sequence: int, part: PartitionSlice, dtype: str, nbytes: int) -> None:
        """Refuse a record of frame ``sequence`` whose dtype or byte count is not ``part``'s
        (:func:`~ps_server.core.partitions.check_dtype`, :func:`~ps_server.core.partitions.check_dense_bytes`).

        Raises:
            InvalidRequestError: it is not (the connection closes before its bytes are read).
        """
        plan = self._plan_of()
        assert plan is not None
        try:
            check_dtype(part.key, part.offset, dtype, plan.dtypes[part.key])
            check_dense_bytes(part.key, part.offset, part.length, dtype, nbytes)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"frame {sequence}: {exc}") from None

    def _check_member(self, conn: Connection, sequence: int) -> None:
        """Refuse frame ``sequence`` unless the connection's rank is a live member under its
        incarnation (before any of its bytes are read).

        Raises:
            InvalidRequestError: it is not (the connection closes).
        """
        try:
            self._member(conn.rank, conn.incarnation)
        except PSError as exc:
            self._refusals.refuse("data connection of rank %d closed at frame %d: %s", conn.rank, sequence, exc)
            raise InvalidRequestError(f"frame {sequence} of a rank that is not a live member: {exc}") from None

    def _owned(self) -> Sequence[PartitionSlice]:
        plan = self._plan_of()
        if plan is None:
            raise InvalidRequestError("a frame came before the shard was initialized")
        return plan.owned_by(self.shard_index)
