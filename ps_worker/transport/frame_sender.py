"""Sending a PushPull's frames on the data connections: each on a thread of its own, in one order
across the shards.

A worker pushes to S shards at once. Sent on S connections side by side, the S frames share the
worker's link fairly and all end at the same moment; every shard then steps its last partition
and sends it back, so the link's download ends S partitions after its upload (and, in a streamed
round, its first values come back only once S partitions went up). Sent one partition at a time
in the order (slot 0 of every shard, slot 1 of every shard, ...), with little queued in each
socket (:data:`SEND_BUFFER_BYTES`), each shard's slot *i* lands one partition after the previous
shard's, and the download trails the upload by about one partition: the pipelining of BytePS
(Jiang et al., OSDI 2020, §4: partitions scheduled across servers) on a link that TCP would
otherwise share evenly among the flows.

The order is a schedule, never a condition of correctness: a sender that waits longer than its
send's deadline for its turn goes on, and a sender that ends early (an error, a retry on gRPC)
gives up its turns.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence

import torch

from ps_worker.transport.data_link import DataConnection, DataLinkError

SEND_BUFFER_BYTES = 256 * 1024
"""``SO_SNDBUF`` of a data connection to another host while its frames are sent in order (Linux
doubles it: 512 KiB, about one 1 MiB float32 partition in bfloat16, half of one in float32).
A small buffer keeps the frames of one shard from queueing behind another's on the link: on
emulated 1 Gbit/s links, 2 workers x 4 shards of 25 MB step in about 235 ms (bench/EMULATED.md)."""


class SendOrder:
    """The order in which the frames of one PushPull go out: slot 0 of every shard, then slot 1 of
    every shard, and so on (shards in index order, each with its own partition count); or, for
    frames begun during backward, the order in which the partitions' gradients are ready
    (:meth:`add`).

    Args:
        counts: shard -> its partitions in this push; shards that send no frame (their push goes
            on gRPC, or is begun during backward) have none, and take no turns. None: no turns
            until :meth:`add`.
    """

    def __init__(self, counts: dict[int, int] | None = None) -> None:
        self._position: dict[tuple[int, int], int] = {}
        self._taken: dict[int, int] = {}
        self._next = 0
        self._done: set[int] = set()
        self._gone: set[int] = set()
        self._cond = threading.Condition()
        counts = counts or {}
        for i in range(max(counts.values(), default=0)):
            for k in sorted(counts):
                if i < counts[k]:
                    self.add(k)

    def add(self, k: int) -> None:
        """Shard ``k``'s next partition takes the next turn (a frame begun during backward: its
        gradient is ready); a shard that gave up has its turn passed at once."""
        with self._cond:
            i = self._taken.get(k, 0)
            self._taken[k] = i + 1
            j = self._position[(k, i)] = len(self._position)
        if k in self._gone:
            self._finish([j])

    def wait(self, k: int, i: int, timeout: float) -> None:
        """Until every partition before shard ``k``'s ``i``-th was sent, or for ``timeout`` seconds
        at most (then it goes on out of order)."""
        with self._cond:
            j = self._position.get((k, i))
            if j is not None:
                self._cond.wait_for(lambda: self._next >= j, timeout=timeout)

    def sent(self, k: int, i: int) -> None:
        """Shard ``k``'s ``i``-th partition is sent (or will not be): the turn passes on."""
        self._finish([self._position.get((k, i))])

    def give_up(self, k: int) -> None:
        """Shard ``k`` sends nothing more in this order (its frame ended, or failed)."""
        with self._cond:
            self._gone.add(k)
            turns = [j for (shard, _), j in self._position.items() if shard == k]
        self._finish(turns)

    def _finish(self, turns: Sequence[int | None]) -> None:
        with self._cond:
            self._done.update(j for j in turns if j is not None)
            while self._next in self._done:
                self._next += 1
            self._cond.notify_all()


class FrameSender:
    """A push frame sent on a thread of its own, then its end record, while the caller receives
    the answer on the same connection (a frame begun during backward: from its start, while
    backward goes on).

    Args:
        conn: shard ``k``'s data connection.
        sequence: the frame's number.
        count: the frame's partitions.
        values: the i-th partition sent -> (its slot on the wire: its position among all the
            shard's partitions, as a diloco round of one fragment sends some; its values as they
            go on the wire, a 1-D CPU tensor), called on the sending thread just before it is sent
            (a cast is made there, overlapping the sending of the partitions before it; a frame
            begun during backward waits there for the next gradient ready).
        order: the push's order across shards (None: send at once); this sender takes its turns in
            it and gives up the rest when it ends.
        k: the shard's index in ``order``.
    """

    def __init__(
        self,
        conn: DataConnection,
        sequence: int,
        count: int,
        values: Callable[[int], tuple[int, torch.Tensor]],
        order: SendOrder | None = None,
        k: int = 0,
    ) -> None:
        self.sent = 0
        self.error: DataLinkError | None = None

        def send() -> None:
            deadline = time.monotonic() + conn.timeout
            try:
                sent = 0
                for i in range(count):
                    slot, tensor = values(i)
                    if order is not None:
                        order.wait(k, i, max(0.0, deadline - time.monotonic()))
                    try:
                        sent += conn.send_slot(sequence, slot, tensor)
                    finally:
                        if order is not None:
                            order.sent(k, i)
                self.sent = sent + conn.send_end(sequence, count)
            except DataLinkError as exc:
                self.error = exc
            except Exception as exc:  # a cast that failed: the receive must not wait for the frame
                conn.close()
                self.error = DataLinkError(f"sending frame {sequence} failed: {exc!r}")
            finally:
                if order is not None:
                    order.give_up(k)

        self._thread = threading.Thread(target=send, name=f"push-frame-{sequence}", daemon=True)
        self._thread.start()

    def join(self, quiet: bool = False) -> int:
        """Wait for the send (it is bounded by the connection's timeout); returns the bytes sent.

        Raises:
            DataLinkError: the send failed (unless ``quiet``).
        """
        self._thread.join()
        if self.error is not None and not quiet:
            raise self.error
        return self.sent


def keep_in_order(conn: DataConnection) -> None:
    """Queue little in ``conn``'s socket (:data:`SEND_BUFFER_BYTES`), so that the order of a
    :class:`SendOrder` holds on the wire (from then on: the connection keeps the setting)."""
    if conn.ordered:
        return
    try:
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    except OSError:
        return  # a closed connection: its send fails and says so
    conn.ordered = True
