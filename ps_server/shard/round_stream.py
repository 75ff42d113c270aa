"""Streamed sync rounds: a round stepped partition by partition while its pushes still arrive.

A sync round closes once every expected rank's whole push is in, and only then may a worker read
the version it makes; on a network, every link then carries the upload and only after it the
download. A *streamed* round steps partition (slot) ``i`` as soon as every expected rank's
partition ``i`` has landed on its data connection, and each rank's PushPull sends slot ``i``'s new
values back at once, while the later partitions are still arriving: upload and download overlap,
as in BytePS's per-partition pipelining (Jiang et al., "A Unified Architecture for Accelerating
Distributed DNN Training in Heterogeneous GPU/CPU Clusters", OSDI 2020, §4).

The round's semantics do not change. Stepping a slot early is speculation: the store copies the
slot first (:meth:`~ps_server.shard.store.ParameterStore.step_slot`), and the values sent are marked
speculative: they are the version only once the call answers OK. The round still closes the usual
way (:class:`~ps_server.policy.sync.SyncPolicy`: every push held whole, all or nothing, then
closed), and at the close :func:`settle` checks that the stream stepped exactly that round: the same
ranks, each through its streamed push, the same hyperparameters, no skip, every slot. Then the
stepped slots are the round's step, bitwise what applying the round at once gives (each slot is the
rank-ordered mean of the same gradients, stepped by the same single-tensor torch.optim code).
Otherwise (a rank evicted or gone mid-round, a push refused, a skip, a checkpoint or a read that
needs the parameters mid-round) every stepped slot is put back and the round is applied as if never
streamed; the streaming calls then tell their workers to drop what they received and send the
round's values again.

Everything here runs under the shard's lock; :class:`RoundStreams` is what the shard's facade calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from ps_common.codec import decode, torch_dtype
from ps_common.errors import UpdateRefusedError
from ps_common.partition import WirePartition
from ps_server.policy.base import ShardCore
from ps_server.policy.rounds import aggregate
from ps_server.policy.types import Hyperparameters, hyper_key

if TYPE_CHECKING:
    import threading

    from ps_server.membership.ranks import PushStamp

log = logging.getLogger(__name__)


class Shard(ShardCore, Protocol):
    """What a streamed round reads and writes of its shard (the facade,
    :class:`~ps_server.shard.shard.Shard`) besides what its policy does, under the shard's lock."""

    stream: RoundStream | None  # type: ignore[assignment]
    streamed_rounds: int
    unstreamed_rounds: int

    @property
    def pending_mode(self) -> str: ...


@dataclass
class RoundStream:
    """The streamed state of one sync round."""

    round: int
    ranks: frozenset[int]
    """The ranks the round expected when it began streaming; a change ends the stream."""
    num_slots: int
    hyper: dict[int, Hyperparameters] = field(default_factory=dict)
    """Rank -> the hyperparameters of its push (ranks taking part)."""
    grads: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    """Slot -> rank -> that rank's gradient of the slot (the parameter's dtype)."""
    stepped: set[int] = field(default_factory=set)
    pushed: set[int] = field(default_factory=set)
    """Ranks whose whole push the round holds through this stream (or held before it began)."""
    ended: str = ""
    """Why the stream ended before its round closed ("" while it runs or once committed)."""
    undone: int = 0
    """Slots stepped and put back when it ended."""
    committed: bool = False
    casts: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    """(slot, wire dtype) -> the stepped slot's values cast for the wire (sent to every rank)."""

    @property
    def live(self) -> bool:
        return not self.ended and not self.committed

    def stop(self, shard: Shard, why: str) -> None:
        """:func:`end`, when this is the shard's stream (the policy's
        :class:`~ps_server.policy.types.StreamHook`)."""
        if shard.stream is self:
            end(shard, why)

    def settle(self, shard: Shard, round_: int, ranks: Sequence[int], hyper: Hyperparameters) -> bool:
        """:func:`settle` of an unskipped round, when this is the shard's stream (else False)."""
        return shard.stream is self and settle(shard, round_, ranks, hyper, False)


def gradient_of(part: WirePartition, param_dtype: str) -> torch.Tensor:
    """A checked dense partition as the round holds it: its values in the parameter's dtype
    (a read-only view of the received bytes when the wire dtype is the parameter's), exactly as
    :func:`~ps_server.core.partitions.match_partitions` makes it."""
    tensor = decode(part.data, part.dtype, part.length)
    return tensor if part.dtype == param_dtype else tensor.to(torch_dtype(param_dtype))


def join(shard: Shard, stamp: PushStamp, hyper: Hyperparameters, skip: bool, setting: str) -> RoundStream | None:
    """The stream of round ``stamp.clock`` that ``stamp``'s push takes part in, or None when the
    push goes the usual way (not sync, a quorum, a skip, a duplicate or a push for another round,
    a stream of this round that already ended, ``setting`` off). Holds the shard's lock."""
    store, rounds = shard.store, shard.rounds
    if setting == "off" or store is None or not shard.policy.may_stream(shard.settings) or shard.pending_mode:
        return None
    if stamp.clock != rounds.round or stamp.rank in rounds.pending:
        return None
    member = shard.membership.members[stamp.rank] if stamp.rank < len(shard.membership.members) else None
    if member is None or member.incarnation != stamp.incarnation or (stamp.incarnation, stamp.clock) in member.history:
        return None
    expected = frozenset(shard.membership.counted_in(rounds.round))
    if stamp.rank not in expected or (setting == "auto" and len(expected) < 2):
        return None
    stream = shard.stream
    if stream is not None and stream.round != rounds.round:
        end(shard, "a new round began")
        stream = None
    if stream is None:
        stream = shard.stream = RoundStream(rounds.round, expected, len(store.tensors))
        for rank, grads in rounds.pending.items():  # held whole before the stream began
            stream.hyper[rank] = rounds.hyper.get(rank, ())
            stream.pushed.add(rank)
            for i, g in enumerate(grads):
                stream.grads.setdefault(i, {})[rank] = g
        if rounds.skips:
            end(shard, "a rank asked to skip the round's step")
    if not stream.live:
        return None
    if skip:
        end(shard, f"rank {stamp.rank} asked to skip the round's step")
        return None
    stream.hyper[stamp.rank] = hyper
    if len({hyper_key(h) for h in stream.hyper.values()}) > 1:
        end(shard, "its ranks sent different hyperparameters")
        return None
    return stream


def offer(shard: Shard, stream: RoundStream, rank: int, slot: int, grad: torch.Tensor) -> None:
    """Rank's checked gradient of ``slot``; steps the slot once every rank's is in. Holds the lock."""
    if not stream.live or shard.stream is not stream:
        return
    stream.grads.setdefault(slot, {})[rank] = grad
    step_ready(shard, stream)


def step_ready(shard: Shard, stream: RoundStream) -> None:
    """Step every slot whose gradients are all in, while the round's ranks are those it began
    with and each has said its hyperparameters. Holds the lock; wakes the waiting calls."""
    if not stream.live or shard.stream is not stream:
        return
    if frozenset(shard.membership.counted_in(stream.round)) != stream.ranks:
        end(shard, "the round's ranks changed")
        return
    if stream.hyper.keys() != stream.ranks:
        return
    store = shard.store
    assert store is not None
    stepped = False
    for slot, by_rank in sorted(stream.grads.items()):
        if slot in stream.stepped or by_rank.keys() != stream.ranks:
            continue
        (mean,) = aggregate({r: [g] for r, g in by_rank.items()})
        buffer = by_rank[min(by_rank)] if slot in store.buffer_index else None
        try:
            store.step_slot(slot, mean, next(iter(stream.hyper.values())), buffer)
        except UpdateRefusedError as exc:
            end(shard, f"slot {slot}'s step was refused ({exc})")  # the close refuses the round
            return
        stream.stepped.add(slot)
        stepped = True
    if stepped:
        shard.notify()


def end(shard: Shard, why: str) -> None:
    """End the shard's stream before its round closes: put every stepped slot back. Holds the lock."""
    stream = shard.stream
    if stream is None or not stream.live:
        return
    if shard.store is not None:
        shard.store.undo_slots()
    shard.unstreamed_rounds += 1
    shard.counters.streamed("put_back")
    stream.ended, stream.undone = why, len(stream.stepped)
    stream.casts.clear()
    stream.stepped.clear()
    log.info("shard %d: round %d goes unstreamed: %s", shard.shard_index, stream.round, why)
    shard.notify()


def held(shard: Shard, rank: int, stream: RoundStream | None) -> None:
    """Rank's whole push joined the open round: through ``stream`` (its streamed call), or not
    (then a stream of the round cannot stand for it). Holds the lock."""
    current = shard.stream
    if current is None or not current.live or current.round != shard.rounds.round:
        return
    if stream is current:
        current.pushed.add(rank)
    else:
        end(shard, f"rank {rank}'s push came outside the stream")


def settle(shard: Shard, round_: int, ranks: Sequence[int], hyper: Hyperparameters, skipped: bool) -> bool:
    """At the close of ``round_`` (held pushes of ``ranks``, agreed ``hyper``): True when the
    stream stepped exactly this round, which then stands as its step; otherwise any stepped slot is
    put back (False: apply the round as usual). Holds the lock."""
    stream = shard.stream
    if stream is None or stream.round != round_ or not stream.live:
        return False
    exact = (
        not skipped
        and frozenset(ranks) == stream.ranks == stream.pushed
        and len(stream.stepped) == stream.num_slots
        and all(hyper_key(h) == hyper_key(hyper) for h in stream.hyper.values())
    )
    if not exact:
        end(shard, "the round closed otherwise than it was streamed")
        return False
    assert shard.store is not None
    shard.store.commit_slots()
    shard.streamed_rounds += 1
    shard.counters.streamed("streamed")
    stream.committed = True
    stream.grads.clear()
    stream.casts.clear()
    shard.notify()
    return True


def wire_values(shard: Shard, stream: RoundStream, slot: int, wire: str) -> torch.Tensor:
    """A stepped slot's values as they go on the wire: the parameters' own memory, or their cast to
    ``wire``, made once per slot for every rank of the round. Holds the lock."""
    assert shard.store is not None
    t = shard.store.tensors[slot]
    if not wire or t.dtype == torch_dtype(wire):
        return t
    cast = stream.casts.get((slot, wire))
    if cast is None:
        cast = stream.casts[(slot, wire)] = t.to(torch_dtype(wire))
    return cast


class RoundStreams:
    """The streamed rounds of one shard: :meth:`join`, :meth:`leave` and :meth:`slots` (the data
    plane's calls) take the shard's lock, the condition ``cond``; :meth:`slots` waits on it (which
    releases it while it waits). :meth:`held` and :meth:`end` run under it (the caller holds it).

    Args:
        shard: the shard whose stream (``shard.stream``) these are, as :class:`Shard` says.
        cond: the shard's condition.
    """

    def __init__(self, shard: Shard, cond: threading.Condition) -> None:
        self._shard, self._cond = shard, cond

    def join(self, stamp: PushStamp, hyper: Hyperparameters, skip: bool, setting: str) -> RoundStream | None:
        """The stream of round ``stamp.clock`` this push takes part in; see :func:`join`."""
        with self._cond:
            return join(self._shard, stamp, hyper, skip, setting)

    def leave(self, stream: RoundStream, rank: int, why: str) -> None:
        """A streamed call failed: end ``stream`` (``why``) unless ``rank``'s push is in it."""
        with self._cond:
            if stream.live and rank not in stream.pushed:
                end(self._shard, why)

    def slots(
        self,
        stream: RoundStream,
        rank: int,
        landed: Callable[[], Iterable[tuple[int, torch.Tensor]]],
        sent: set[int],
        wire: str,
        until: float | None,
        active: Callable[[], bool],
        poll: float,
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Offer ``rank``'s gradients that ``landed()`` yields (slot, checked gradient), step what is
        complete, and wait until a slot not in ``sent`` is stepped or the stream ends; returns the
        slots ready and their values on the wire (``wire`` dtype). Ends the stream when ``until``
        (time.monotonic seconds) passes or ``active()`` is False; re-checks every ``poll`` seconds."""
        with self._cond:
            shard = self._shard
            while True:
                for slot, grad in landed():
                    offer(shard, stream, rank, slot, grad)
                step_ready(shard, stream)
                ready = sorted(stream.stepped - sent)
                if ready or not stream.live:
                    return ready, [wire_values(shard, stream, slot, wire) for slot in ready]
                left = None if until is None else until - time.monotonic()
                if (left is not None and left <= 0) or not active():
                    end(shard, f"rank {rank}'s call ended waiting for the round's slots")
                    return [], []
                self._cond.wait(poll if left is None else min(poll, left))

    def held(self, rank: int, stream: RoundStream | None) -> None:
        """Rank's whole push joined the open round; see :func:`held`."""
        held(self._shard, rank, stream)

    def end(self, why: str) -> None:
        """End the open round's stream; see :func:`end`."""
        end(self._shard, why)
