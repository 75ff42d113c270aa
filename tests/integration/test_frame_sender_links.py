"""A push frame's sending thread (ps_worker/transport/frame_sender.py) on a real data connection that
breaks: the sender fails with a link error, never with an exception of its thread, and a partition
that cannot be made closes the connection so that the call's receive does not wait for it."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from ps_common import dataconn
from ps_worker.transport.data_link import DataConnection, DataLinkError
from ps_worker.transport.frame_sender import FrameSender

TIMEOUT = 30.0


class ShardThatStopsReading:
    """A listening socket on 127.0.0.1 that answers one data connection's hello and reads nothing
    more."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.peer: socket.socket | None = None
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.listener.settimeout(TIMEOUT)
        peer, _ = self.listener.accept()
        peer.settimeout(TIMEOUT)
        dataconn.recv_exact(peer, memoryview(bytearray(dataconn.HELLO.size)))
        self.peer = peer
        peer.sendall(dataconn.REPLY.pack(dataconn.MAGIC, 0))

    def close(self) -> None:
        self.thread.join(TIMEOUT)
        for s in (self.peer, self.listener):
            if s is not None:
                s.close()


def test_a_connection_closed_while_its_frame_is_sent_fails_the_sender_with_a_link_error() -> None:
    shard = ShardThatStopsReading()
    try:
        conn = DataConnection("127.0.0.1", shard.port, 0, 1, timeout=TIMEOUT)
        slots = [torch.zeros(1 << 10) for _ in range(4)]

        def values(i: int) -> tuple[int, torch.Tensor]:
            if i == 2:
                conn.close()  # between two partitions, as the call's receive does when the shard goes away
            return i, slots[i]

        sending = FrameSender(conn, 1, len(slots), values)
        with pytest.raises(DataLinkError):
            sending.join()
    finally:
        shard.close()


def test_a_partition_that_cannot_be_made_closes_the_connection_and_fails_the_sender() -> None:
    shard = ShardThatStopsReading()
    try:
        conn = DataConnection("127.0.0.1", shard.port, 0, 1, timeout=TIMEOUT)

        def values(i: int) -> tuple[int, torch.Tensor]:
            raise RuntimeError("cast failed")

        sending = FrameSender(conn, 1, 2, values)
        with pytest.raises(DataLinkError, match="cast failed"):
            sending.join()
        assert conn.closed  # the receive of the same call fails at once instead of waiting
    finally:
        shard.close()
