"""A data connection's hello: who may open a connection to a shard (the worker token, as the gRPC
calls carry it, and a rank of the cluster)."""

from __future__ import annotations

import hmac
import ipaddress
import socket
import time
from collections.abc import Callable

import grpc

from ps_common import dataconn
from ps_common.errors import InvalidRequestError, PSError
from ps_server.dataplane.connection import Connection
from ps_server.dataplane.refusals import Refusals
from ps_server.service.rank_tokens import RankTokens

HELLO_SECONDS = 10.0
"""A connection must send its hello within this many seconds."""

REFUSED = grpc.StatusCode.INVALID_ARGUMENT.value[0]
"""The hello reply's status when the rank is outside the cluster (0: accepted)."""


class HelloCheck:
    """Reads and checks a connection's hello.

    Args:
        token, admin_token: a hello must carry one of them when ``token`` is set.
        rank_tokens: per-rank tokens (``--rank-tokens``): a hello of a rank that has one must carry
            it (or the admin token); ``token`` is then accepted only for ranks without one.
        member: called with (rank, incarnation); raises InvalidRequestError when the rank is
            outside the cluster (the hello is refused), another PSError when it is not a live member
            now (accepted: each push frame's first record is checked again).
        refusals: where refused hellos are counted and logged.
    """

    def __init__(
        self,
        token: str,
        admin_token: str,
        rank_tokens: RankTokens | None,
        member: Callable[[int, int], None],
        refusals: Refusals,
    ) -> None:
        self._tokens = [t.encode() for t in (token, admin_token) if t] if token else []
        self._shared = token.encode()
        self._admin = admin_token.encode()
        self._rank_tokens = rank_tokens
        self._member = member
        self._refusals = refusals

    def read(self, sock: socket.socket) -> Connection | None:
        """Read the hello on ``sock`` within :data:`HELLO_SECONDS`: the connection it opens (not yet
        answered), or None when it is refused (a rank outside the cluster is answered
        :data:`REFUSED`; any other refusal gets no answer).

        Raises:
            OSError, DataConnectionError: the connection broke or the hello did not come in time.
        """
        deadline = time.monotonic() + HELLO_SECONDS
        magic, protocol, rank, incarnation, session, token_len = dataconn.recv_struct(sock, dataconn.HELLO, deadline)
        if magic != dataconn.MAGIC or protocol != dataconn.PROTOCOL or token_len > dataconn.MAX_TOKEN_BYTES:
            self._refusals.refuse(
                "data connection closed: not a grpc-ps data connection of protocol %d", dataconn.PROTOCOL
            )
            return None
        given = bytearray(token_len)
        dataconn.recv_exact(sock, memoryview(given), deadline)
        if not self._token_admits(rank, bytes(given)):
            self._refusals.refuse("data connection of rank %d closed: wrong token", rank)
            return None
        try:
            self._member(rank, incarnation)
        except InvalidRequestError as exc:  # outside the cluster: no frame of it can ever be taken
            self._refusals.refuse("data connection of rank %d refused: %s", rank, exc)
            sock.sendall(dataconn.REPLY.pack(dataconn.MAGIC, REFUSED))
            return None
        except PSError:
            pass  # not live now: each frame's first record is checked
        conn = Connection(sock, rank, incarnation, session)
        try:
            conn.loopback = ipaddress.ip_address(sock.getpeername()[0]).is_loopback
        except (OSError, ValueError):
            pass
        return conn

    def _token_admits(self, rank: int, given: bytes) -> bool:
        """Whether a hello of ``rank`` with the token ``given`` may open a connection: with rank
        tokens, the rank's own token (or the admin token; the shared token only for a rank without
        one of its own); otherwise one of the tokens, when there are any. Compared in constant time."""
        if self._rank_tokens is None:
            return not self._tokens or any(hmac.compare_digest(given, t) for t in self._tokens)
        own = self._rank_tokens.token_of(rank)
        admin = bool(self._admin) and hmac.compare_digest(given, self._admin)
        if own is not None:
            return hmac.compare_digest(given, own.encode()) or admin
        return admin or (bool(self._shared) and hmac.compare_digest(given, self._shared))
