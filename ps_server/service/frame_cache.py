"""The response messages of a shard's reads, encoded once per version (the service layer's side of
``Shard.pull``/``push_pull``/``exchange``: the shard hands a :class:`~ps_server.shard.views.Snapshot`
to an encoder under its lock; the encoders here build the messages of :mod:`ps_common.frames`).

Every rank reading the same version with the same ``wire_dtype`` and packing shares one copy of the
encoded parameters: :class:`FrameCache` keeps the messages of the newest (version, store epoch)
only, keyed by (version, store epoch, wire dtype, packed).
"""

from __future__ import annotations

from collections.abc import Callable

from ps_common import frames
from ps_common.codec import torch_dtype
from ps_common.errors import InvalidRequestError
from ps_common.fragments import owned_slots
from ps_common.plan import Plan
from ps_server.shard.views import Snapshot

Encoder = Callable[[Snapshot], list[bytes]]
"""Encodes a snapshot into response messages (called under the shard's lock)."""


def encode_exchange(snapshot: Snapshot) -> list[bytes]:
    """ExchangeResponse messages of an exchange's d (one partition per message, as stored; not cached)."""
    return frames.response_frames(snapshot.version, snapshot.partitions, snapshot.tensors)


class FrameCache:
    """Encoded read responses of one shard. Used under that shard's lock only (its encoders and
    :meth:`check_single` run there), so it needs no lock of its own."""

    def __init__(self) -> None:
        self._frames: dict[tuple[int, int, str, int], list[bytes]] = {}
        self._groups: dict[tuple[str, str, tuple[int, ...] | None], list[list[int]]] = {}

    def groups(
        self, plan: Plan, shard_index: int, wire_dtype: str, slots: tuple[int, ...] | None = None
    ) -> list[list[int]]:
        """How a PushPull response of shard ``shard_index`` packs its partitions (see
        :func:`ps_common.frames.packing`): lists of partition indices, in plan order (``slots``: of
        those partitions only, indices into ``slots``; a diloco fragment round)."""
        key = (plan.digest, wire_dtype, slots)
        groups = self._groups.get(key)
        if groups is None:
            owned = plan.owned_by(shard_index)
            owned = owned if slots is None else tuple(owned[i] for i in slots)
            wire = torch_dtype(wire_dtype) if wire_dtype else None
            itemsizes = [(wire or torch_dtype(plan.dtypes[p.key])).itemsize for p in owned]
            groups = frames.packing([(p.key, p.length) for p in owned], itemsizes, plan.partition_bytes)
            self._groups[key] = groups
        return groups

    def check_single(self, plan: Plan, shard_index: int, wire_dtype: str, fragment: tuple[int, int] = (1, 0)) -> None:
        """PushPullOnce: the response must be one message (``fragment``: as :meth:`encoder`).

        Raises:
            InvalidRequestError: the shard's partitions need more than one message of ``partition_bytes``.
        """
        slots = owned_slots(plan, shard_index, *fragment)
        if len(self.groups(plan, shard_index, wire_dtype, slots)) > 1:
            raise InvalidRequestError(
                f"Shard {shard_index}'s partitions do not fit in one message of {plan.partition_bytes} "
                "bytes; call PushPull (a stream) instead of PushPullOnce."
            )

    def encoder(self, wire_dtype: str = "", packed: bool = False, fragment: tuple[int, int] = (1, 0)) -> Encoder:
        """An encoder of the parameters at a snapshot's version.

        Args:
            wire_dtype: send float parameters as this narrower float ("" = as they are; the shard
                checked it against the plan).
            packed: pack small partitions together up to ``partition_bytes`` per message
                (PushPull); otherwise one partition per message (Pull).
            fragment: (F, outer round): with F > 1 (diloco), only the partitions of the round's
                fragment (:func:`ps_common.fragments.owned_slots`).

        Returns:
            A callable giving the messages (PullResponse/PushPullResponse layout, version in field
            1), built once per (version, store epoch, wire_dtype, packed).
        """

        def encode(snapshot: Snapshot) -> list[bytes]:
            slots = owned_slots(snapshot.plan, snapshot.shard_index, *fragment)
            key = (snapshot.version, snapshot.epoch, wire_dtype, int(packed) + 2 * (fragment[1] % fragment[0]))
            cached = self._frames.get(key)
            if cached is not None:
                return cached
            every = range(len(snapshot.partitions)) if slots is None else slots
            out = frames.response_frames(
                snapshot.version,
                [snapshot.partitions[i] for i in every],
                [snapshot.tensors[i] for i in every],
                torch_dtype(wire_dtype) if wire_dtype else None,
                self.groups(snapshot.plan, snapshot.shard_index, wire_dtype, slots) if packed else None,
            )
            self._frames = {k: v for k, v in self._frames.items() if k[:2] == key[:2]}
            self._frames[key] = out
            return out

        return encode
