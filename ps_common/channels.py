"""Client channels to shards, plaintext or TLS (docs/architecture.md#8-security), and the flags that choose them.

Imports no torch, so ``ps-admin`` starts in a fraction of a second; ``PSClient`` uses it too.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Any

import grpc

from ps_common.flags import FlagParser

ADDRESS_HINT = "write HOST:PORT, e.g. 127.0.0.1:50051 ([::1]:50051 for IPv6)"

LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 (bracketed too) and localhost: a host on this machine."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_address(address: str) -> tuple[str, int]:
    """Split a shard address ``HOST:PORT`` (``[V6]:PORT`` for IPv6) into host and port, before any
    connection is attempted, so a typo is refused at once and by name.

    Returns:
        (host, port), the host without IPv6 brackets; port in 1..65535.

    Raises:
        ValueError: no host, no port, a port that is not a number or is out of 1..65535, or an
            unbracketed IPv6 address; the message names the address.
    """
    text = address.strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ValueError(f"Shard address {address!r} has no port; {ADDRESS_HINT}.")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError(f"Shard address {address!r} has an unclosed IPv6 bracket; {ADDRESS_HINT}.")
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"Shard address {address!r} looks like IPv6 without brackets; {ADDRESS_HINT}.")
    if not host:
        raise ValueError(f"Shard address {address!r} has no host; {ADDRESS_HINT}.")
    if not port:
        raise ValueError(f"Shard address {address!r} has no port after ':'; {ADDRESS_HINT}.")
    if not (port.isascii() and port.isdigit()):
        raise ValueError(f"Shard address {address!r} has port {port!r}, which is not a number; {ADDRESS_HINT}.")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"Shard address {address!r} has port {int(port)}, outside 1..65535; {ADDRESS_HINT}.")
    return host, int(port)


def parse_servers(text: str | Sequence[str], flag: str = "--servers") -> list[str]:
    """The shard addresses of ``--servers`` (comma-separated, or already a list), each checked with
    :func:`parse_address`; returned stripped, in order. ``unix:PATH`` targets pass unchecked.

    Raises:
        ValueError: no address at all, or a malformed one (named in the message, with ``flag``).
    """
    entries = text.split(",") if isinstance(text, str) else list(text)
    servers = [s.strip() for s in entries if s.strip()]
    if not servers:
        raise ValueError(f"{flag} needs at least one shard address; {ADDRESS_HINT}.")
    for address in servers:
        if address.startswith("unix:"):
            continue
        try:
            parse_address(address)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    return servers


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
