"""Client channels to shards, plaintext or TLS (DESIGN section 8), and the flags that choose them.

Imports no torch, so ``ps-admin`` starts in a fraction of a second; ``PSClient`` uses it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from ps_server.flags import FlagParser


def tls_flags(p: FlagParser) -> None:
    """``--tls-ca``, ``--tls-cert``, ``--tls-key`` (twins ``PS_TLS_*``) of the commands that call shards."""
    p.flag("--tls-ca", default="", help="PEM CA of the shards' certificates: connect with TLS")
    p.flag("--tls-cert", default="", help="PEM client certificate for mutual TLS")
    p.flag("--tls-key", default="", help="PEM private key of --tls-cert")


def credentials(
    tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None
) -> grpc.ChannelCredentials | None:
    """TLS credentials from PEM files: the CA that signed the shards' certificates (``tls_ca``), and
    a client certificate and key for mutual TLS (``tls_cert``, ``tls_key``); None (plaintext) when
    ``tls_ca`` is not given. The files are read once, here.

    Raises:
        ValueError: only one of ``tls_cert``/``tls_key``, or a client certificate without ``tls_ca``.
        OSError: a file cannot be read.
    """
    if bool(tls_cert) != bool(tls_key):
        raise ValueError(
            "tls_cert and tls_key (--tls-cert, --tls-key) go together: pass both for mutual TLS, or neither."
        )
    if tls_cert and not tls_ca:
        raise ValueError("A client certificate needs tls_ca (--tls-ca), the CA of the shards' certificates.")
    if not tls_ca:
        return None

    def read(path: str | None) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))


def secure_or_plain(
    address: str, creds: grpc.ChannelCredentials | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A channel to ``address`` with ``creds`` (TLS), or plaintext when ``creds`` is None."""
    if creds is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, creds, options=list(options))


def channel(
    address: str,
    options: Sequence[tuple[str, Any]] = (),
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> grpc.Channel:
    """A channel to ``address``: TLS when ``tls_ca`` is given, mutual TLS with ``tls_cert``/``tls_key``,
    plaintext otherwise (see :func:`credentials`).

    Raises:
        ValueError: inconsistent TLS files. OSError: a file cannot be read.
    """
    return secure_or_plain(address, credentials(tls_ca, tls_cert, tls_key), options)
