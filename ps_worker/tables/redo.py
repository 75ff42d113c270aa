"""sync: this rank's PushRows of the last table rounds, per shard, as they went on the wire, so that
a shard restarted behind the table rounds it had answered gets them pushed again
(docs/faults.md; the dense rounds' counterpart is :mod:`ps_worker.redo`).

A sync table round closes on a shard when every counted rank pushed it; a PushRows is answered as
soon as the shard holds it, before the round closes, so even a shard with ``--durable-acks`` can
restart without the last round it answered, and one with periodic checkpoints without several.
Every rank pushes those rounds again, the same bytes in the same order, so each closes with the
same rows as before: bitwise the run without the fault. The log is bounded in bytes (the client's
``redo_bytes``); a round it no longer holds is named (:class:`~ps_worker.redo.LostRoundsError`).
"""

from __future__ import annotations

from collections import OrderedDict

from ps_proto.v1 import ps_pb2
from ps_worker.redo import LostRoundsError


class TableRedo:
    """The PushRows requests of the last table rounds, per shard, within ``max_bytes`` in all.

    Args:
        num_shards: shards of the cluster. max_bytes: the bound (0: keep nothing).
    """

    def __init__(self, num_shards: int, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.kept: list[OrderedDict[int, ps_pb2.PushRowsRequest]] = [OrderedDict() for _ in range(num_shards)]
        self.nbytes = 0

    def record(self, k: int, request: ps_pb2.PushRowsRequest) -> None:
        """Keep shard ``k``'s answered ``request`` (its ``clock`` is the table round); the oldest
        rounds go first when the bound is passed."""
        if self.max_bytes <= 0:
            return
        kept = self.kept[k]
        old = kept.pop(request.clock, None)
        if old is not None:
            self.nbytes -= old.ByteSize()
        kept[request.clock] = request
        self.nbytes += request.ByteSize()
        while self.nbytes > self.max_bytes:
            oldest = min((d for d in self.kept if d), key=lambda d: next(iter(d)))
            _, dropped = oldest.popitem(last=False)
            self.nbytes -= dropped.ByteSize()

    def rounds(self, k: int, start: int, end: int, address: str) -> list[ps_pb2.PushRowsRequest]:
        """Shard ``k``'s requests of table rounds ``start .. end-1``, in order.

        Raises:
            LostRoundsError: one of them is no longer kept (naming the shard, the rounds and what to do).
        """
        kept = self.kept[k]
        missing = [c for c in range(start, end) if c not in kept]
        if missing:
            raise LostRoundsError(
                f"{address}: shard {k} restarted behind table rounds it had answered ({start}..{end - 1}); this "
                f"rank no longer holds round{'s' if len(missing) > 1 else ''} {missing[0]}..{missing[-1]} of them "
                f"(the redo log keeps {self.max_bytes} bytes: raise redo_bytes / PS_REDO_BYTES), so they cannot be "
                "pushed again: restart the job from the shards' checkpoints, or run it with --durable-acks."
            )
        return [kept[c] for c in range(start, end)]
