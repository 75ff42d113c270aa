"""A sync rank's redo log: its pushes of the rounds a shard could still lose, to push them again.

A shard that checkpoints every N versions without ``--durable-acks`` answers a round before the
round is on disk; a ``kill -9`` takes it back to its newest checkpoint, and the rounds it applied
since are lost there while the other shards kept them. Each rank keeps, per shard, its pushes of
the rounds from that shard's newest checkpoint on (``JoinResponse``/``HeartbeatResponse``
``checkpointed_version``), exactly as they went on the wire (values copied, hyperparameters, skip,
sample count). When the restarted shard takes this rank's push in an earlier round than the one
its current push is for, the rank pushes the lost rounds again, in order, each one answered before
the next (:meth:`ps_worker.transport.calls.ShardCalls.push_again`): every rank does the same, so each lost
round closes with the same gradients, hyperparameters and ranks as before, and the shard ends
bitwise where it was (``docs/faults.md``). The log is bounded in bytes (``redo_bytes``): a round
pushed out of it cannot be redone, and the rank says so by name (:class:`LostRoundsError`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence

from ps_common import frames
from ps_common.errors import PreconditionError
from ps_proto.v1 import ps_pb2

DEFAULT_REDO_BYTES = 256 << 20
"""The default bound of a rank's redo log (``PS_REDO_BYTES``, ``--redo-bytes``), in bytes."""


class LostRoundsError(PreconditionError):
    """A restarted shard lost rounds this rank no longer holds (its redo log dropped them, or the
    rank restarted since): they cannot be pushed again, and the shards would close them with other
    gradients than before."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One round's push of this rank, as it went on the wire.

    Attributes:
        round: the sync round (clock) it was stamped for.
        outs: per shard, its partitions (``values`` copied: 1-D CPU tensors in the wire dtype).
        hyperparameters: per parameter group, the step's values. skip: AMP asked to skip.
        samples: diloco's sample count (None: not counted).
        nbytes: bytes of the copied values and indices.
    """

    round: int
    outs: Sequence[Sequence[frames.OutPartition]]
    hyperparameters: Sequence[Mapping[str, float]]
    skip: bool
    samples: int | None
    nbytes: int


def _copied(p: frames.OutPartition) -> frames.OutPartition:
    indices = None if p.indices is None else p.indices.clone()
    return frames.OutPartition(p.key, p.offset, p.length, p.values.clone(), indices)


class RedoLog:
    """Per shard, the rounds a kill -9 of that shard could lose, with this rank's pushes of them.

    Thread-safe (recorded by the step's thread, pruned by the heartbeat's).

    Args:
        num_shards: shards of the job. max_bytes: bound on the copied values kept (0: keep none).
    """

    def __init__(self, num_shards: int, max_bytes: int = DEFAULT_REDO_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"redo_bytes must be >= 0 (bytes), not {max_bytes}.")
        self.max_bytes = max_bytes
        self.keep_from: list[int | None] = [None] * num_shards
        """Per shard, its newest checkpoint's version (None: the shard loses no answered round)."""
        self.entries: dict[int, Entry] = {}
        self.nbytes = 0
        self.dropped_before = 0
        """Rounds below this were dropped for the byte bound (cannot be redone)."""
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """Some shard can lose answered rounds, and the log may keep them."""
        return self.max_bytes > 0 and any(v is not None for v in self.keep_from)

    def checkpointed(self, k: int, version: int | None) -> None:
        """Shard ``k`` reported its newest checkpoint (``version``; None: it loses no answered
        round): forget the rounds every shard has on disk."""
        with self._lock:
            if self.keep_from[k] != version:  # unchanged: nothing more to forget (record prunes what it adds)
                self.keep_from[k] = version
                self._prune()

    def learn(self, k: int, answer: ps_pb2.JoinResponse | ps_pb2.HeartbeatResponse | ps_pb2.PushResponse) -> None:
        """:meth:`checkpointed` as shard ``k``'s Join, Heartbeat or push answer says."""
        has = answer.HasField("checkpointed_version")
        self.checkpointed(k, int(answer.checkpointed_version) if has else None)

    def record(
        self,
        round: int,
        outs: Sequence[Sequence[frames.OutPartition]],
        hyperparameters: Sequence[Mapping[str, float]],
        skip: bool,
        samples: int | None = None,
    ) -> None:
        """Keep this rank's push of ``round`` (copies of ``outs``, one list per shard); the oldest
        rounds leave once the log passes ``max_bytes``. Nothing is kept while no shard can lose a
        round (:attr:`active`)."""
        if not self.active:
            return
        copied = [[_copied(p) for p in shard] if self.keep_from[k] is not None else [] for k, shard in enumerate(outs)]
        nbytes = sum(
            p.values.nbytes + (0 if p.indices is None else p.indices.nbytes) for shard in copied for p in shard
        )
        entry = Entry(round, copied, [dict(h) for h in hyperparameters], skip, samples, nbytes)
        with self._lock:
            old = self.entries.pop(round, None)
            self.nbytes += nbytes - (old.nbytes if old is not None else 0)
            self.entries[round] = entry
            self._prune()
            while self.nbytes > self.max_bytes and self.entries:
                first = min(self.entries)
                self.nbytes -= self.entries.pop(first).nbytes
                self.dropped_before = max(self.dropped_before, first + 1)

    def _prune(self) -> None:
        kept = [v for v in self.keep_from if v is not None]
        floor = min(kept) if kept else None
        for r in [r for r in self.entries if floor is None or r < floor]:
            self.nbytes -= self.entries.pop(r).nbytes

    def rounds(self, k: int, start: int, end: int) -> list[Entry]:
        """This rank's pushes to shard ``k`` of rounds ``start .. end - 1``, in order.

        Raises:
            LostRoundsError: a round of them is not in the log.
        """
        with self._lock:
            missing = [r for r in range(start, end) if r not in self.entries]
            if missing:
                why = (
                    f"the redo log dropped rounds before {self.dropped_before} to stay within "
                    f"{self.max_bytes} bytes (raise --redo-bytes / PS_REDO_BYTES)"
                    if missing[0] < self.dropped_before
                    else "this process did not push them (it restarted since, or joined later)"
                )
                raise LostRoundsError(
                    f"Shard {k} restarted from an older checkpoint and lost rounds {start}..{end - 1}; this rank "
                    f"no longer holds its pushes of rounds {missing[0]}..{missing[-1]}: {why}. The job cannot end "
                    "where an uninterrupted run ends; restart it from the checkpoints the shards share, or run the "
                    "shards with --durable-acks so that no answered round is lost."
                )
            return [self.entries[r] for r in range(start, end)]

    def last_round(self) -> int | None:
        """The newest round kept (a push lost with the shard's open round is that one)."""
        with self._lock:
            return max(self.entries) if self.entries else None
