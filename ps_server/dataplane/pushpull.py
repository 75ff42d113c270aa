"""PushPull whose partitions travel on the rank's data connection (``PushHeader.data_sequence``,
:mod:`ps_common.dataconn`), with streamed sync rounds (:mod:`ps_server.shard.round_stream`).

:class:`DataPushPull` is held by :class:`~ps_server.service.parameters.ParameterServicer`, which
hands it the calls whose header says ``data_sequence``. The call's header, answer, errors and deadline stay on
gRPC; the partitions come on the data connection, and the values go back there before the call
answers. Every wait is bounded by the call's deadline; every send by the call's time left.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
import torch

from ps_common import dataconn, fields, frames
from ps_common.codec import torch_dtype
from ps_common.errors import DataPathError, InvalidRequestError
from ps_common.fragments import fragments_in_force, owned_slots
from ps_common.partition import WirePartition
from ps_common.plan import Plan
from ps_common.wire import hyperparameters_from_proto
from ps_server.core.partitions import Admitted, Intake
from ps_server.dataplane.connections import POLL_SECONDS, DataPlane, wire_slots
from ps_server.membership.ranks import PushStamp
from ps_server.service.request_streams import Request
from ps_server.service.rpc import deadline, push_response, push_stamp, wire_dtype
from ps_server.shard import round_stream
from ps_server.shard.views import Snapshot

if TYPE_CHECKING:
    from ps_server.shard.counters import ShardCounters
    from ps_server.shard.shard import Shard


class DataPushPull:
    """PushPull on data connections (see the module docstring).

    Args:
        shard: the shard served. data: its data connections (None: refuses every such call with
            DataPathError, and the worker sends the partitions on the stream).
        counters: where every accepted push is counted.
        adopt: follows the membership record a request relays (the servicer's).
    """

    def __init__(
        self,
        shard: Shard,
        data: DataPlane | None,
        counters: ShardCounters,
        adopt: Callable[[Any], None],
    ) -> None:
        self.shard = shard
        self.data = data
        self.counters = counters
        self._adopt = adopt
        self._slots: dict[tuple[int, int, str], list[torch.Tensor]] = {}
        """(version, store epoch, wire dtype) -> a version's values on the wire, shared by the ranks that
        read it; entries of other versions are dropped when a new version is encoded (at most one per
        wire dtype)."""

    def push_pull(self, req: Request, context: grpc.ServicerContext) -> Iterator[bytes]:
        """PushPull with its partitions on the rank's data connection (``data_sequence``): the same
        checks and semantics as on the stream (every partition checked against the plan and for
        finiteness before the push; all or nothing). The values go back on the connection first
        (streamed slot by slot as a streamed round steps them, :mod:`ps_server.shard.round_stream`; else
        as one frame once the round closed), then the push's answer alone on the stream. A call that
        fails after its frame began tells the worker on the connection (:data:`dataconn.ABORT`), so
        the worker never waits there for values that are not coming.

        Raises:
            DataPathError: the frame did not come (the worker sends it again on the stream).
            InvalidRequestError: partitions on the stream too; bad partitions.
        """
        header, first = req.header, req.first
        data = self.data
        if data is None:
            raise DataPathError("This shard has no data connections; send the partitions on the PushPull stream.")
        if req.parts:
            raise InvalidRequestError(
                "A PushPull with data_sequence carries its partitions on the data connection only."
            )
        self._adopt(header)
        dtype = wire_dtype(first.ints.get(fields.WIRE_DTYPE, 0))
        plan = req.plan  # the header's, checked (ps_server.service.request_streams)
        rank, incarnation, sequence = header.rank, header.incarnation, header.data_sequence
        stamp = push_stamp(header)
        hyper = hyperparameters_from_proto(header)
        ended = False  # the worker has the answer's end (values, or an ABORT) on its connection
        stream: round_stream.RoundStream | None = None
        try:
            setting = self.shard.stream_rounds
            if setting == "auto" and data.loopback(rank):
                setting = "off"  # on one machine the link is a memory copy: nothing to overlap
            stream = self.shard.join_stream(stamp, hyper, header.skip, setting)
            if stream is not None:
                parts = self._stream_slots(stream, plan, stamp, sequence, dtype, context)
            else:
                intake = Intake(plan, self.shard.shard_index, "gradient")
                taken = data.take(rank, incarnation, sequence, deadline(context), context.is_active)
                parts = Admitted(intake, [intake.add(p) for p in taken])
            result, version, (epoch, slots, live), told = self.shard.push_pull(
                stamp,
                header.version,
                plan,
                parts,
                deadline(context),
                self._slot_encoder(dtype, stream is not None, (fragments_in_force(self.shard.settings), header.clock)),
                dtype,
                hyper=hyper,
                skip=header.skip,
                stream=stream,
                request_epoch=header.membership_epoch,
            )
            if stream is not None and stream.committed and stream.round + 1 == version:
                data.send_records(rank, incarnation, sequence, [dataconn.end(sequence, len(slots))], 5.0)
                live = False
            else:
                if stream is not None:  # it ended: drop the speculative values, the round's follow
                    data.send_records(rank, incarnation, sequence, [dataconn.marker(sequence, dataconn.ABORT, 1)], 5.0)
                    slots = wire_slots(slots, torch_dtype(dtype) if dtype else None, copy=False)
                data.send(rank, incarnation, sequence, slots, context.time_remaining())
            ended = True
        finally:
            if stream is not None and not ended:
                self.shard.leave_stream(stream, rank, f"rank {rank}'s streamed call failed")
            if not ended:
                try:
                    data.send_records(rank, incarnation, sequence, [dataconn.marker(sequence, dataconn.ABORT, 0)], 1.0)
                except DataPathError:
                    pass  # no connection: the worker's receive fails with it
        self.counters.pushed(result)
        if live and self.shard.values_key() != (version, epoch):
            # the parameters were sent from their own memory and a round closed meanwhile (a
            # quorum round, an eviction): the values may mix two versions. The call fails and the
            # worker pushes the same stamp again on gRPC, answered as a duplicate with one version.
            raise DataPathError(f"Version {version} moved on while it was sent; pull it again.")
        answer = push_response(result, self.shard.redo_from, told)
        yield (
            frames.bytes_field(fields.PUSH_ANSWER, answer.SerializeToString())
            + frames.uint_field(fields.VERSION, version)
            + frames.uint_field(fields.DATA_SEQUENCE, sequence)
        )

    def _stream_slots(
        self,
        stream: round_stream.RoundStream,
        plan: Plan,
        stamp: PushStamp,
        sequence: int,
        dtype: str,
        context: grpc.ServicerContext,
    ) -> list[WirePartition]:
        """A streamed round's part of one rank's PushPull: offer each partition of the rank's frame
        as it lands, and send each slot's new values as soon as the round stepped it (after a
        :data:`dataconn.SPECULATE` marker). Returns the frame's checked partitions for the push.
        When the stream ends early, the rest goes the usual way (the caller sends ABORT).

        Raises:
            DataPathError: the connection closed or the frame did not come in time.
            InvalidRequestError: a bad partition (NaN...); the stream ends.
        """
        shard, data = self.shard, self.data
        assert data is not None
        rank, incarnation = stamp.rank, stamp.incarnation
        intake = Intake(plan, shard.shard_index, "gradient")
        checked: dict[int, WirePartition] = {}
        landed_data: dict[int, bytes | memoryview] = {}
        sent: set[int] = set()
        wait = deadline(context)
        until = None if wait is None else time.monotonic() + wait
        data.send_records(rank, incarnation, sequence, [dataconn.marker(sequence, dataconn.SPECULATE)], wait)
        n = stream.num_slots

        def landed() -> Iterator[tuple[int, torch.Tensor]]:
            """The rank's partitions landed since the last look, checked (the shard's lock is held)."""
            now, _ = data.peek(rank, incarnation, sequence)
            for slot in sorted(now.keys() - checked.keys()):
                landed_data[slot] = now[slot].data
                part = intake.add(now[slot])
                grad = round_stream.gradient_of(part, plan.dtypes[part.key])
                if part.dtype != plan.dtypes[part.key]:  # the push holds the widened values
                    part = dataclasses.replace(part, dtype=plan.dtypes[part.key], data=dataconn.byte_view(grad))
                checked[slot] = part
                yield slot, grad

        while len(sent) < n:
            ready, outgoing = shard.stream_slots(
                stream, rank, landed, sent, dtype, until, context.is_active, POLL_SECONDS
            )
            if not stream.live:
                break
            buffers: list[bytes | memoryview] = []
            for slot, values in zip(ready, outgoing, strict=True):
                buffers += dataconn.record(sequence, slot, values)
            left = None if until is None else until - time.monotonic()
            data.send_records(rank, incarnation, sequence, buffers, left)
            sent.update(ready)
        taken = data.take(
            rank,
            incarnation,
            sequence,
            None if until is None else max(0.0, until - time.monotonic()),
            context.is_active,
        )
        out = []
        for i, part in enumerate(taken):
            mine = checked.get(i)
            out.append(mine if mine is not None and landed_data.get(i) is part.data else intake.add(part))
        return out

    def _slot_encoder(
        self, dtype: str, lazy: bool = False, fragment: tuple[int, int] = (1, 0)
    ) -> Callable[[Snapshot], tuple[int, list[torch.Tensor], bool]]:
        """A snapshot's partitions for the data connection, under the shard's lock: (store epoch,
        slots, live). sync without a wire dtype, or ``lazy`` (a streamed call, which sends them only
        when its stream ended: the caller casts), the parameters' own memory (``live``; in sync a
        version moves only once every live rank pushed again, so a rank's answer normally goes out
        whole, and the sender checks); otherwise copies made once per (version, store epoch, wire
        dtype), only the newest version's kept. ``fragment``: (F, outer round); with F > 1 (diloco) only
        the round's fragment's partitions (:func:`ps_common.fragments.owned_slots`)."""

        def encode(snapshot: Snapshot) -> tuple[int, list[torch.Tensor], bool]:
            slots = owned_slots(snapshot.plan, snapshot.shard_index, *fragment)
            tensors = list(snapshot.tensors) if slots is None else [snapshot.tensors[i] for i in slots]
            if lazy:
                return snapshot.epoch, tensors, True
            if not dtype and self.shard.policy.holds_pushes:
                return snapshot.epoch, wire_slots(tensors, None, copy=False), True
            key = (snapshot.version, snapshot.epoch, f"{dtype}/{fragment[1] % fragment[0]}")
            cached = self._slots.get(key)
            if cached is None:
                cached = wire_slots(tensors, torch_dtype(dtype) if dtype else None)
                self._slots = {k: v for k, v in self._slots.items() if k[:2] == key[:2]}
                self._slots[key] = cached
            return snapshot.epoch, cached, False

        return encode
