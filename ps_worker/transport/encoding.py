"""The worker's wire encoding, pure given a plan: requests to frames, response frames to tensors.

No sockets and no clocks here: :class:`WireCodec` turns a step's tensors (1-D CPU tensors, one per
key) into the bytes of ps.v1 requests (the same bytes ``SerializeToString`` would produce, see
``ps_common.frames``), and the frames a shard answers with into those tensors. Every request the
worker sends carrying partitions (Init, Push, PushPull, Exchange) is built here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ps_common import fields, frames
from ps_common.codec import dtype_to_proto, torch_dtype, wire_dtype_allowed
from ps_common.optimizer import OptimizerSpec
from ps_common.plan import PartitionSlice, Plan
from ps_common.wire import optimizer_to_proto, plan_to_proto
from ps_proto.v1 import ps_pb2
from ps_worker.compression import TopK

WIRE_DTYPES = ("float32", "float16", "bfloat16")
"""Values of ``wire_dtype``: float16/bfloat16 halve the bytes of a float32 model."""


@dataclass(frozen=True)
class Stamp:
    """What every push carries besides its gradients (docs/architecture.md#4-idempotence-and-errors).

    Attributes:
        rank, incarnation: the pushing worker.
        clock: sync: the round; otherwise the worker's step count.
        version: the shard version the gradient was computed on.
        hyperparameters: per parameter group, the step's values (an lr scheduler's).
        skip: AMP found inf: skip the step.
    """

    rank: int
    incarnation: int
    clock: int
    version: int
    hyperparameters: Sequence[Mapping[str, float]] = ()
    skip: bool = False
    membership_epoch: int = 0
    """The membership epoch the worker knows."""
    membership: ps_pb2.MembershipEpoch | None = None
    """The record itself, for a shard that reported an older epoch (relayed)."""
    session: int = 0
    """The rank's session on the shard pushed to (``JoinResponse.session``)."""
    samples: int | None = None
    """diloco: the samples the outer gradient stands for (``PushHeader.sample_count``; None: the
    rank does not count them, unset on the wire; 0: it weighs nothing)."""
    traceparent: str = ""
    """The push's trace context (``PushHeader.traceparent``; "" with tracing off)."""


class WireCodec:
    """Encodes requests and decodes responses for one plan.

    Args:
        plan: the partition plan (every worker computes the same).
        wire_dtype: gradients go and weights come as this dtype (float16/bfloat16/float32), or
            None: each parameter's own dtype.
        compressor: top-k sparsification of gradients (with error feedback), or None: dense.
        keys: only these parameters' partitions go and come (a diloco round of one fragment,
            :mod:`ps_common.fragments`); None: every parameter's.

    Raises:
        ValueError: ``wire_dtype`` is not narrower than (or equal to) every parameter's dtype.
    """

    def __init__(
        self,
        plan: Plan,
        wire_dtype: str | None = None,
        compressor: TopK | None = None,
        keys: frozenset[str] | None = None,
    ) -> None:
        if wire_dtype is not None:
            bad = sorted(key for key, name in plan.dtypes.items() if not wire_dtype_allowed(wire_dtype, name))
            if bad:
                raise ValueError(
                    f"wire_dtype {wire_dtype} is not narrower than parameters {bad[:4]}; "
                    "use it with float32 models, or leave it unset."
                )
        self.plan = plan
        self.wire_dtype = wire_dtype
        self.compressor = compressor
        self.wire = torch_dtype(wire_dtype) if wire_dtype else None
        self.wire_enum = dtype_to_proto(wire_dtype) if wire_dtype else ps_pb2.DTYPE_UNSPECIFIED
        self.keys = keys
        self.slots: list[tuple[int, ...]] = [
            tuple(i for i, p in enumerate(plan.owned_by(k)) if keys is None or p.key in keys)
            for k in range(plan.num_shards)
        ]
        """Per shard: the position of each of ``owned[k]`` among all the shard's partitions (its
        slot on a data connection, whose records name partitions by it)."""
        self.owned: list[tuple[PartitionSlice, ...]] = [
            tuple(plan.owned_by(k)[i] for i in self.slots[k]) for k in range(plan.num_shards)
        ]
        self._lengths = [{(p.key, p.offset): p.length for p in owned} for owned in self.owned]
        self.single_response = [len(self.packing(k, sparse=False)) <= 1 for k in range(plan.num_shards)]
        """Per shard: its PushPull response is one message (then a one-message request is PushPullOnce)."""
        self.request_groups = [self.packing(k, sparse=True) or [[]] for k in range(plan.num_shards)]
        """Per shard: how its PushPull request packs, indices into ``owned[k]`` per message."""

    # ------------------------------------------------------------------ partitions
    def to_wire(self, part: PartitionSlice, flat: torch.Tensor, compress: bool) -> frames.OutPartition:
        """Partition ``part`` of ``flat`` (a parameter's 1-D CPU tensor) as it goes on the wire: a
        view of the tensor, a copy cast to ``wire_dtype``, or (``compress``: gradients only) its
        top-k entries, which updates the error-feedback memory (once per push: callers keep the
        result for retries)."""
        values = flat[part.offset : part.offset + part.length]
        if compress and self.compressor is not None:
            idx, top = self.compressor.compress((part.key, part.offset), values, self.wire)
            return frames.OutPartition(part.key, part.offset, part.length, top, idx)
        if self.wire is not None and values.dtype != self.wire:
            values = values.to(self.wire)
        return frames.OutPartition(part.key, part.offset, part.length, values)

    def out_partitions(self, k: int, flats: Mapping[str, torch.Tensor], compress: bool) -> list[frames.OutPartition]:
        """Shard ``k``'s partitions of ``flats`` as they go on the wire (see :meth:`to_wire`)."""
        return [self.to_wire(part, flats[part.key], compress) for part in self.owned[k]]

    def packing(self, k: int, sparse: bool) -> list[list[int]]:
        """How shard ``k``'s partitions pack into PushPull messages (:func:`frames.packing`): indices
        into its partitions, one list per message. ``sparse``: as top-k pushes them (values and
        uint32 indices); otherwise dense, as the shard packs its response (it runs the same
        function on the same sizes: one group means PushPullOnce)."""
        owned = self.owned[k]
        itemsizes = [(self.wire or torch_dtype(self.plan.dtypes[p.key])).itemsize for p in owned]
        topk = self.compressor.k if sparse and self.compressor is not None else None
        return frames.packing([(p.key, p.length) for p in owned], itemsizes, self.plan.partition_bytes, topk)

    # ------------------------------------------------------------------ requests
    def push_header(self, stamp: Stamp, data_sequence: int = 0) -> bytes:
        """A serialized ``PushHeader`` (``data_sequence``: PushPull's partitions are that frame on
        the data connection)."""
        return ps_pb2.PushHeader(
            rank=stamp.rank,
            incarnation=stamp.incarnation,
            clock=stamp.clock,
            version=stamp.version,
            plan_digest=self.plan.digest,
            groups=[ps_pb2.GroupHyperparameters(values=h) for h in stamp.hyperparameters],
            skip=stamp.skip,
            membership_epoch=stamp.membership_epoch,
            membership=stamp.membership,
            data_sequence=data_sequence,
            session=stamp.session,
            sample_count=stamp.samples,
            traceparent=stamp.traceparent,
        ).SerializeToString(deterministic=True)

    def push_head(self, stamp: Stamp) -> bytes:
        """The first message of a Push stream: ``PushRequest(header=...)``."""
        return _message_field(fields.HEADER, self.push_header(stamp))

    def push_pull_head(self, stamp: Stamp, data_sequence: int = 0) -> bytes:
        """The header fields of a PushPull request's first message (header, wire dtype)."""
        return frames.bytes_field(fields.HEADER, self.push_header(stamp, data_sequence)) + frames.uint_field(
            fields.WIRE_DTYPE, self.wire_enum
        )

    def push_messages(self, head: bytes, outs: Iterable[frames.OutPartition]) -> Iterable[bytes]:
        """A Push stream: ``head``, then one ``PushRequest(partition=...)`` per partition, built lazily."""
        yield head
        for o in outs:
            yield frames.build([o])

    def pull_request(
        self, rank: int, incarnation: int, min_version: int, membership_epoch: int = 0
    ) -> ps_pb2.PullRequest:
        """A ``PullRequest`` for the whole of a shard's partitions."""
        return ps_pb2.PullRequest(
            rank=rank,
            incarnation=incarnation,
            min_version=min_version,
            plan_digest=self.plan.digest,
            wire_dtype=self.wire_enum,
            membership_epoch=membership_epoch,
        )

    def exchange_messages(
        self,
        k: int,
        rank: int,
        incarnation: int,
        clock: int,
        flats: Mapping[str, torch.Tensor],
        membership_epoch: int = 0,
        session: int = 0,
    ) -> list[bytes]:
        """An Exchange stream to shard ``k``: the header, then one partition of ``flats`` per message
        (the parameters x, exact or in ``wire_dtype``; never top-k). ``session``: the rank's on shard ``k``."""
        header = ps_pb2.ExchangeHeader(
            rank=rank,
            incarnation=incarnation,
            clock=clock,
            plan_digest=self.plan.digest,
            membership_epoch=membership_epoch,
            session=session,
        )
        head = _message_field(fields.HEADER, header.SerializeToString(deterministic=True))
        return [head, *(frames.build([o]) for o in self.out_partitions(k, flats, compress=False))]

    def init_messages(
        self,
        k: int,
        rank: int,
        incarnation: int,
        optimizer: OptimizerSpec,
        values: Mapping[str, torch.Tensor],
        membership_epoch: int = 0,
        version: int = 0,
    ) -> list[bytes]:
        """An Init stream to shard ``k`` at ``version``: ``InitRequest(header=...)``, then one
        ``InitRequest(partition=...)`` per partition with the exact values (each cast to the plan's
        dtype; ``values``: key -> tensor of any shape and device). The bytes equal the protobuf messages'
        ``SerializeToString(deterministic=True)`` (map entries sorted by key) (``tests/unit/test_encoding.py``)."""
        header = ps_pb2.InitHeader(
            rank=rank,
            incarnation=incarnation,
            plan=plan_to_proto(self.plan),
            optimizer=optimizer_to_proto(optimizer),
            membership_epoch=membership_epoch,
            version=version,
        )
        msgs = [_message_field(fields.HEADER, header.SerializeToString(deterministic=True))]
        dtypes = self.plan.dtypes
        flats = {key: values[key].detach().to("cpu", torch_dtype(dtypes[key])).reshape(-1) for key in dtypes}
        for part in self.owned[k]:
            piece = flats[part.key][part.offset : part.offset + part.length]
            msgs.append(frames.build([frames.OutPartition(part.key, part.offset, part.length, piece)]))
        return msgs

    # ------------------------------------------------------------------ responses
    def decode(
        self,
        k: int,
        replies: Iterable[bytes | memoryview],
        into: Mapping[str, torch.Tensor],
        address: str = "",
        on_message: Callable[[int], None] | None = None,
    ) -> tuple[int, int, ps_pb2.PushResponse | None]:
        """Copy the partitions of shard ``k``'s response frames into ``into`` (key -> 1-D tensor).

        Args:
            k: the shard index.
            replies: serialized PullResponse / PushPullResponse / ExchangeResponse messages.
            into: key -> 1-D CPU tensor of the parameter's dtype, written in place.
            address: the shard's address, for error messages.
            on_message: called with each message's size in bytes as it is read.

        Returns:
            (version, payload bytes received, the push's answer if a frame carried one).

        Raises:
            RuntimeError: a partition outside the plan, or not every partition of the shard.
        """
        dtypes = self.plan.dtypes
        owned = self._lengths[k]
        version, received, seen, answer = 0, 0, 0, None
        for raw in replies:
            msg = frames.read(raw)
            version = msg.ints.get(fields.VERSION, 0)
            if fields.PUSH_ANSWER in msg.blobs:
                answer = ps_pb2.PushResponse.FromString(msg.blobs[fields.PUSH_ANSWER])
            for p in msg.partitions:
                if (
                    owned.get((p.key, p.offset)) != p.length
                    or len(p.indices)
                    or p.dtype not in (dtypes[p.key], self.wire_dtype)
                ):
                    raise RuntimeError(f"Shard {address} sent a partition outside the plan: {p.key}")
                into[p.key][p.offset : p.offset + p.length].copy_(frames.view(p))
                received, seen = received + len(p.data), seen + 1
            if on_message is not None:
                on_message(len(raw))
        if seen != len(owned):
            raise RuntimeError(f"Shard {address} sent {seen} of {len(owned)} partitions.")
        return version, received, answer


def _message_field(field: int, payload: bytes) -> bytes:
    """A set message field of a oneof: tag and length even when ``payload`` is empty (as protobuf
    writes a oneof member that is set)."""
    return frames.tag(field, frames.LEN) + frames.varint(len(payload)) + payload
