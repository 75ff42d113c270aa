"""Push frames parked on a shard's data connections until their PushPull takes them: the bound on
their bytes (``--max-parked-bytes``) and their expiry (``--data-frame-timeout``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from ps_common.errors import InvalidRequestError
from ps_common.partition import WirePartition
from ps_server.dataplane.connection import Connection
from ps_server.dataplane.refusals import Refusals

log = logging.getLogger(__name__)


class Parking:
    """The parked frames of one shard's data connections: per connection one frame being read and
    one complete frame waiting (:class:`~ps_server.dataplane.connection.ParkedFrames`), at most
    ``max_parked_bytes()`` over all connections, each released ``frame_timeout`` seconds after its
    last partition landed or a call last looked at it.

    Args:
        cond: the plane's condition; it guards the connections and their frames, and is notified
            when a frame completes.
        connections: the registered connections (called holding ``cond``).
        frame_timeout: seconds a parked frame may wait (see above).
        max_parked_bytes: called for the most bytes parked over all connections (0: no bound).
        refusals: where a connection closed over the bound is counted and logged.
    """

    def __init__(
        self,
        cond: threading.Condition,
        connections: Callable[[], Iterable[Connection]],
        frame_timeout: float,
        max_parked_bytes: Callable[[], int],
        refusals: Refusals,
    ) -> None:
        self._cond = cond
        self._connections = connections
        self.frame_timeout = frame_timeout
        self._max_parked_bytes = max_parked_bytes
        self._refusals = refusals
        self.expired = 0
        """Parked frames released after :attr:`frame_timeout` (complete or partial)."""

    @property
    def parked_bytes(self) -> int:
        """Bytes of push frames parked now (complete and being read) over all connections."""
        with self._cond:
            return sum(c.frames.nbytes for c in self._connections())

    def park(self, conn: Connection, sequence: int, nbytes: int) -> None:
        """Count ``nbytes`` more of the frame being read, within :attr:`max_parked_bytes`.

        Raises:
            InvalidRequestError: over the bound (the connection closes, the frame is dropped).
        """
        limit = self._max_parked_bytes()
        with self._cond:
            parked = sum(c.frames.nbytes for c in self._connections())
            if limit and parked + nbytes > limit:
                over = True
            else:
                over = False
                conn.frames.filling_bytes += nbytes
                conn.frames.filling_at = time.monotonic()
        if over:
            self._refusals.refuse(
                "data connection of rank %d closed at frame %d: %d bytes more would park %d, over the bound of %d",
                conn.rank,
                sequence,
                nbytes,
                parked + nbytes,
                limit,
            )
            raise InvalidRequestError(f"frame {sequence}: over the shard's bound of {limit} parked bytes")

    def landed(self, conn: Connection, sequence: int, parts: dict[int, WirePartition]) -> None:
        """Frame ``sequence`` being read holds ``parts`` (slot -> partition) so far."""
        with self._cond:
            conn.frames.filling, conn.frames.filling_at = (sequence, dict(parts)), time.monotonic()

    def complete(self, conn: Connection, sequence: int, parts: dict[int, WirePartition]) -> None:
        """Frame ``sequence`` is whole: it replaces the complete frame waiting, if any."""
        with self._cond:
            frames = conn.frames
            frames.ready = (sequence, [parts[i] for i in sorted(parts)])
            frames.ready_bytes, frames.ready_at = frames.filling_bytes, time.monotonic()
            frames.filling, frames.filling_bytes = None, 0
            self._cond.notify_all()

    def take(self, conn: Connection, sequence: int) -> list[WirePartition] | None:
        """Frame ``sequence`` if it is complete (released: the caller owns it), else None; called
        holding the plane's condition."""
        frames = conn.frames
        if frames.ready is not None and frames.ready[0] == sequence:
            parts = frames.ready[1]
            frames.ready, frames.ready_bytes = None, 0
            return parts
        return None

    def peek(self, conn: Connection, sequence: int) -> tuple[dict[int, WirePartition], bool]:
        """The partitions of frame ``sequence`` landed so far (slot -> partition), and whether the
        frame is complete; a call looking at it keeps it from expiring. Called holding the plane's
        condition."""
        frames = conn.frames
        if frames.ready is not None and frames.ready[0] == sequence:
            frames.ready_at = time.monotonic()  # a call is at it: not parked
            return dict(enumerate(frames.ready[1])), True
        if frames.filling is not None and frames.filling[0] == sequence:
            frames.filling_at = time.monotonic()
            return frames.filling[1], False
        return {}, False

    def expire(self, closed: Callable[[], bool], lost: Callable[[Connection, str], None]) -> None:
        """Release parked frames :attr:`frame_timeout` seconds old until ``closed()`` (the plane's
        expiry thread): a complete one is dropped, a partial one's connection is ``lost``."""
        period = min(1.0, self.frame_timeout / 4)
        while True:
            stale: list[Connection] = []
            with self._cond:
                if closed():
                    return
                now = time.monotonic()
                for conn in self._connections():
                    frames = conn.frames
                    if frames.ready is not None and now - frames.ready_at > self.frame_timeout:
                        log.info("data connection of rank %d: frame %d expired untaken", conn.rank, frames.ready[0])
                        frames.ready, frames.ready_bytes = None, 0
                        self.expired += 1
                    if frames.filling_bytes and now - frames.filling_at > self.frame_timeout:
                        stale.append(conn)
                        self.expired += 1
                self._cond.wait(period)
            for conn in stale:
                lost(conn, f"its frame was not complete within {self.frame_timeout:g} s")
