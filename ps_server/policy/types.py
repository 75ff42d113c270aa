"""Types the consistency policies share with the shard and the data plane (no behaviour of a mode).

:data:`Gradients` and :data:`Hyperparameters` are what a push carries; :class:`StreamHook` is what
a policy may ask of a streamed round (``ps_server.shard.round_stream`` implements it, the policies
only call it, so the pure policies import no data-plane code).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

Gradients = Sequence[torch.Tensor]
"""One 1-D tensor per partition owned by the shard, in plan order."""

Hyperparameters = Sequence[Mapping[str, float]]
"""Per parameter group, the hyperparameters a push sets for its step (empty: none)."""


def hyper_key(hyper: Hyperparameters) -> tuple[tuple[tuple[str, float], ...], ...]:
    """A hashable, order-free form of ``hyper`` (equal for the same groups and values)."""
    return tuple(tuple(sorted(g.items())) for g in hyper)


class StreamHook(Protocol):
    """A sync round being streamed slot by slot (``ps_server.shard.round_stream.RoundStream``), as the
    sync policy sees it at the round's close. Both methods run under the shard's lock."""

    def stop(self, shard: Any, why: str) -> None:
        """End the stream before its round closes (every stepped slot is put back); ``why`` is logged."""

    def settle(self, shard: Any, round_: int, ranks: Sequence[int], hyper: Hyperparameters) -> bool:
        """At the close of ``round_`` (held pushes of ``ranks``, agreed ``hyper``): True when the stream
        stepped exactly this round, which then stands as its step; False: apply the round whole."""
