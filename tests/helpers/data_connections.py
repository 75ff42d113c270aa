"""Raw data connections to a shard (``ps_common.dataconn``), for tests that speak the wire
themselves: a hello, and whether the shard closed the connection."""

from __future__ import annotations

import socket

from ps_common import dataconn
from tests.conftest import RPC_TIMEOUT


def raw_connection(port: int, rank: int = 0, incarnation: int = 1, token: str = "", session: int = 0) -> socket.socket:
    """A connection to ``127.0.0.1:port`` that has sent its hello (the reply is not read); a hello
    of a rank outside the cluster is refused (:data:`ps_server.dataplane.connections.REFUSED`). ``session``:
    the rank's ``JoinResponse.session`` (0: none, refused at a frame's first record)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=RPC_TIMEOUT)
    sock.sendall(dataconn.hello(rank, incarnation, token, session))
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the shard closed the connection (EOF or reset), within RPC_TIMEOUT."""
    sock.settimeout(RPC_TIMEOUT)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
