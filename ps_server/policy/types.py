"""Types the consistency policies share with the shard and the data plane (no behaviour of a mode).

:data:`Gradients` and :data:`Hyperparameters` are what a push carries; :class:`StreamHook` is what
a policy may ask of a streamed round (``ps_server.shard.round_stream`` implements it, the policies
only call it, so the pure policies import no data-plane code); :class:`ClipHook`, of the rounds
held for clipping (``ps_server.shard.clipping``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

Gradients = Sequence[torch.Tensor]
"""One 1-D tensor per partition owned by the shard, in plan order."""

Hyperparameters = Sequence[Mapping[str, float]]
"""Per parameter group, the hyperparameters a push sets for its step (empty: none)."""


def hyper_key(hyper: Hyperparameters) -> tuple[tuple[tuple[str, float], ...], ...]:
    """A hashable, order-free form of ``hyper`` (equal for the same groups and values)."""
    return tuple(tuple(sorted(g.items())) for g in hyper)


@dataclass(frozen=True)
class Awaited:
    """Whom a blocked wait waits for: ``what`` it waits for (``round 42``), the ``ranks`` it
    waits on, and what they have not done yet (``missing``: ``pushed``), for the
    :class:`~ps_common.errors.AwaitingRanksError` that ends a call while they are alive."""

    what: str
    ranks: list[int]
    missing: str


class StreamHook(Protocol):
    """A sync round being streamed slot by slot (``ps_server.shard.round_stream.RoundStream``), as the
    sync policy sees it at the round's close. Both methods run under the shard's lock."""

    def stop(self, shard: Any, why: str) -> None:
        """End the stream before its round closes (every stepped slot is put back); ``why`` is logged."""

    def settle(self, shard: Any, round_: int, ranks: Sequence[int], hyper: Hyperparameters) -> bool:
        """At the close of ``round_`` (held pushes of ``ranks``, agreed ``hyper``): True when the stream
        stepped exactly this round, which then stands as its step; False: apply the round whole."""


class ClipHook(Protocol):
    """The shard's rounds held for clipping (``ps_server.shard.clipping.RoundClips``), as the sync
    policy sees them. Every method runs under the shard's lock."""

    @property
    def held_round(self) -> int | None:
        """The round held for its clipping coefficient, if any."""

    def wanted(self, round_: int, ranks: Sequence[int]) -> bool:
        """At the close of ``round_`` (pushes of ``ranks``): whether one of them asked to hold it."""

    def hold(self, round_: int, held: dict[int, Gradients], hyper: Hyperparameters, buffers: Any) -> None:
        """Keep the complete round unapplied until its coefficient comes (a stream of it is put back)."""
