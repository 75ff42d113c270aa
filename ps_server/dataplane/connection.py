"""One worker's data connection to a shard, as the shard holds it after the hello."""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from ps_common import dataconn
from ps_common.partition import WirePartition

SEND_SECONDS = 60.0
"""How long an answer's frame may take to send when the call has no deadline."""


@dataclass
class ParkedFrames:
    """A connection's push frames waiting for their PushPull (:class:`~ps_server.dataplane.parked.Parking`
    changes them, under the plane's condition)."""

    ready: tuple[int, list[WirePartition]] | None = None
    """The last complete push frame not yet taken: (sequence, partitions in slot order)."""
    ready_bytes: int = 0
    ready_at: float = 0.0
    """When ``ready`` completed or a call last looked at it (``time.monotonic()``)."""
    filling: tuple[int, dict[int, WirePartition]] | None = None
    """The push frame being read: (sequence, slot -> partition landed so far)."""
    filling_bytes: int = 0
    """Bytes allocated for the frame being read (landed, and the partition arriving)."""
    filling_at: float = 0.0
    """When a partition of the frame being read last began or landed, or a call last looked at it."""

    @property
    def nbytes(self) -> int:
        """Bytes parked: the complete frame's and the one being read."""
        return self.ready_bytes + self.filling_bytes

    def clear(self) -> None:
        """Drop both frames."""
        self.ready, self.filling, self.ready_bytes, self.filling_bytes = None, None, 0, 0


@dataclass
class Connection:
    """A worker's data connection: its socket, the rank, incarnation and session its hello named,
    and its parked frames. ``error`` and ``frames`` are guarded by the plane's condition."""

    sock: socket.socket
    rank: int
    incarnation: int
    session: int = 0
    """The rank's session the hello carried (``JoinResponse.session``)."""
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    frames: ParkedFrames = field(default_factory=ParkedFrames)
    error: str = ""
    """Why the connection closed ("" while open)."""
    loopback: bool = False
    """The worker dialled from a loopback address (its process shares this machine)."""

    def send(self, buffers: Sequence[bytes | memoryview], deadline: float) -> int:
        """Send ``buffers`` whole, one sender at a time, before ``deadline`` (``time.monotonic()``).
        Returns the bytes sent.

        Raises:
            OSError, DataConnectionError: the connection broke or the worker did not read in time.
        """
        with self.send_lock:
            return dataconn.send_all(self.sock, buffers, deadline)

    def peer_open(self) -> bool:
        """Whether the worker still holds its end of the socket (no EOF or error waiting to be
        read); read by the connection's own thread only, while it runs a call (the worker sends
        nothing meanwhile)."""
        try:
            return bool(self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            return True
        except OSError:
            return False
