"""What ``ps-admin`` asks the shards over ``ps.v1.Admin``: status once or as a stream, config changes,
checkpoints, evictions.

Every call has a deadline; failures come back as results (never raised) so the command can report
each shard on one line.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from ps_common.channels import secure_or_plain
from ps_proto.v1 import ps_pb2, ps_pb2_grpc

FATAL = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
"""Codes no retry cures: ``top`` stops at once on them and watchers do not reconnect."""

HINTS = {
    grpc.StatusCode.UNAUTHENTICATED: "pass --admin-token or set PS_ADMIN_TOKEN",
    grpc.StatusCode.PERMISSION_DENIED: "Admin needs the admin token (PS_ADMIN_TOKEN), not the worker token",
    grpc.StatusCode.UNAVAILABLE: "is the shard running? check --servers, and --tls-ca if the shards serve TLS",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the shard did not answer within --timeout",
}

CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
"""gRPC's own reconnect backoff grows to 120 s; a watcher must see a restarted shard within seconds."""


def channel(address: str, creds: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A channel to one shard, TLS with ``creds`` (plaintext without), that reconnects within about
    2 s of the shard's return."""
    return secure_or_plain(address, creds, CHANNEL_OPTIONS)


def error_line(address: str, code: grpc.StatusCode | None, details: str) -> str:
    """``ps-admin: ADDRESS: CODE: details (hint)`` on one line."""
    name = code.name if code else "ERROR"
    text = " ".join(details.split()) or "no details"
    hint = HINTS.get(code) if code else None
    return f"ps-admin: {address}: {name}: {text}" + (f" ({hint})" if hint else "")


@dataclass(frozen=True)
class ShardResult:
    """What one address answered to GetStatus/WatchStatus: a status, or the error of its call."""

    position: int
    address: str
    status: ps_pb2.ShardStatus | None = None
    code: grpc.StatusCode | None = None
    details: str = ""

    @property
    def ok(self) -> bool:
        return self.status is not None

    def error_line(self) -> str:
        return error_line(self.address, self.code, self.details)


@dataclass(frozen=True)
class Reply:
    """What one address answered to a change (UpdateConfig, EvictWorker); ``sent`` is False when
    the call was not made."""

    position: int
    address: str
    message: Any = None
    code: grpc.StatusCode | None = None
    details: str = ""
    sent: bool = True

    @property
    def ok(self) -> bool:
        return self.message is not None

    def error_line(self) -> str:
        return error_line(self.address, self.code, self.details)


def _code_and_details(exc: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return code, details or ""


def failure(position: int, address: str, exc: grpc.RpcError) -> ShardResult:
    code, details = _code_and_details(exc)
    return ShardResult(position, address, code=code, details=details)


def metadata_of(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying ``authorization: Bearer <token>`` (none for an empty token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


# ---------------------------------------------------------------------------------------- one call per shard
Call = Callable[[ps_pb2_grpc.AdminStub, Sequence[tuple[str, str]], float], Any]
"""``call(stub, metadata, timeout) -> response message`` of one unary Admin RPC."""


def ask(
    addresses: Sequence[str],
    positions: Sequence[int],
    call: Call,
    token: str,
    timeout: float,
    creds: grpc.ChannelCredentials | None = None,
) -> list[Reply]:
    """``call`` on the shards at ``positions`` of ``addresses``, in parallel, over TLS when ``creds``
    are given; one Reply each, in order."""
    metadata = metadata_of(token)

    def one(k: int) -> Reply:
        with channel(addresses[k], creds) as ch:
            try:
                return Reply(k, addresses[k], call(ps_pb2_grpc.AdminStub(ch), metadata, timeout))
            except grpc.RpcError as exc:
                code, details = _code_and_details(exc)
                return Reply(k, addresses[k], code=code, details=details)

    with futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(positions)))) as pool:
        return list(pool.map(one, positions))


def get_status(
    stub: ps_pb2_grpc.AdminStub, *, metadata: Sequence[tuple[str, str]] = (), timeout: float = 5.0
) -> ps_pb2.ShardStatus:
    """One shard's status (``Admin/GetStatus``).

    Raises:
        grpc.RpcError: the call failed (UNAVAILABLE, UNAUTHENTICATED, ...).
    """
    return stub.GetStatus(ps_pb2.GetStatusRequest(), timeout=timeout, metadata=metadata).status


def fetch_all(
    addresses: Sequence[str], token: str, timeout: float, creds: grpc.ChannelCredentials | None = None
) -> list[ShardResult]:
    """Every shard's status, asked in parallel; failures are results too."""
    replies = ask(
        addresses,
        range(len(addresses)),
        lambda stub, md, t: get_status(stub, metadata=md, timeout=t),
        token,
        timeout,
        creds,
    )
    return [ShardResult(r.position, r.address, r.message, r.code, r.details) for r in replies]


def update_config(
    addresses: Sequence[str],
    request: ps_pb2.UpdateConfigRequest,
    token: str,
    timeout: float,
    creds: grpc.ChannelCredentials | None = None,
) -> list[Reply]:
    """``Admin/UpdateConfig`` on shard 0, the membership authority: it schedules the change at a
    version (``request.at_version``, or its next round) and every shard applies it there.

    Returns:
        One Reply (shard 0's).
    """

    def call(stub: ps_pb2_grpc.AdminStub, md: Sequence[tuple[str, str]], t: float) -> ps_pb2.UpdateConfigResponse:
        return stub.UpdateConfig(request, timeout=t, metadata=md)

    return ask(addresses, [0], call, token, timeout, creds)


def resize(
    addresses: Sequence[str],
    num_workers: int,
    at_version: int | None,
    token: str,
    timeout: float,
    creds: grpc.ChannelCredentials | None = None,
) -> Reply:
    """``Admin/Resize`` on shard 0: ranks ``0..num_workers-1`` from ``at_version`` (None: shard 0's
    next round) on, on every shard."""

    def call(stub: ps_pb2_grpc.AdminStub, md: Sequence[tuple[str, str]], t: float) -> ps_pb2.ResizeResponse:
        request = ps_pb2.ResizeRequest(num_workers=num_workers, at_version=at_version)
        return stub.Resize(request, timeout=t, metadata=md)

    return ask(addresses, [0], call, token, timeout, creds)[0]


def evict_worker(
    addresses: Sequence[str], rank: int, token: str, timeout: float, creds: grpc.ChannelCredentials | None = None
) -> list[Reply]:
    """``Admin/EvictWorker`` of ``rank`` on shard 0, which decides for every shard."""

    def call(stub: ps_pb2_grpc.AdminStub, md: Sequence[tuple[str, str]], t: float) -> ps_pb2.EvictWorkerResponse:
        return stub.EvictWorker(ps_pb2.EvictWorkerRequest(rank=rank), timeout=t, metadata=md)

    return ask(addresses, [0], call, token, timeout, creds)


def checkpoint(
    addresses: Sequence[str], token: str, timeout: float, creds: grpc.ChannelCredentials | None = None
) -> list[Reply]:
    """``Admin/Checkpoint`` on every shard, in parallel: each writes its state now and answers (version,
    path on its machine, seconds) once the file is durable. Each shard saves its own current
    version: while training runs they may differ (this is no cluster-wide snapshot)."""

    def call(stub: ps_pb2_grpc.AdminStub, md: Sequence[tuple[str, str]], t: float) -> ps_pb2.CheckpointResponse:
        return stub.Checkpoint(ps_pb2.CheckpointRequest(), timeout=t, metadata=md)

    return ask(addresses, range(len(addresses)), call, token, timeout, creds)


# ---------------------------------------------------------------------------------------- status streams
class SilentStreamError(grpc.RpcError):
    """A status stream that sent nothing for too long; it counts as DEADLINE_EXCEEDED."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.seconds = seconds

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return f"WatchStatus sent nothing for {self.seconds:g} s"


class _Watchdog:
    """Cancels a streaming call when ``stop`` is set or nothing arrived for ``patience`` seconds."""

    TICK = 0.2

    def __init__(self, call: grpc.Call, stop: threading.Event, patience: float) -> None:
        self.call = call
        self.stop = stop
        self.patience = patience
        self.silent = False
        self._last = time.monotonic()
        self._done = threading.Event()
        threading.Thread(target=self._run, name="ps-admin-watchdog", daemon=True).start()

    def heard(self) -> None:
        self._last = time.monotonic()

    def _run(self) -> None:
        while not self._done.is_set():
            if self.stop.wait(min(self.TICK, self.patience)):
                break
            if time.monotonic() - self._last > self.patience:
                self.silent = True
                break
        self.call.cancel()

    def close(self) -> None:
        self._done.set()
        self.call.cancel()


def watch(
    stub: ps_pb2_grpc.AdminStub,
    interval: float,
    *,
    metadata: Sequence[tuple[str, str]] = (),
    timeout: float = 5.0,
    stop: threading.Event | None = None,
) -> Iterator[ps_pb2.ShardStatus]:
    """One shard's status now and then about every ``interval`` seconds, from one
    ``Admin/WatchStatus`` server stream, until ``stop`` is set, the caller closes the generator,
    or the shard ends the stream (it does when it shuts down). The call is cancelled on every exit.

    Args:
        interval: seconds between statuses, 0.1 to 3600 (the shard refuses others).
        timeout: seconds past ``interval`` the stream may stay silent before it counts as dead.

    Raises:
        grpc.RpcError: the call failed, or stayed silent (:class:`SilentStreamError`,
            DEADLINE_EXCEEDED); the caller decides whether to watch again.
    """
    stop = stop or threading.Event()
    call = stub.WatchStatus(ps_pb2.WatchStatusRequest(interval_seconds=interval), metadata=metadata)
    dog = _Watchdog(call, stop, patience=interval + timeout)
    try:
        for reply in call:
            dog.heard()
            yield reply.status
    except grpc.RpcError as exc:
        if dog.silent:
            raise SilentStreamError(dog.patience) from exc
        if not stop.is_set():
            raise
    finally:
        dog.close()


def reconnect_delays(base: float, cap: float, rng: random.Random | None = None) -> Iterator[float]:
    """Seconds to wait before each reconnect: ``min(cap, base * 2**attempt)`` with jitter down to half."""
    rng = rng or random.Random()
    attempt = 0
    while True:
        yield min(cap, base * 2**attempt) * rng.uniform(0.5, 1.0)
        attempt += 1


class Watcher:
    """The latest result of every shard, kept fresh by one WatchStatus stream per shard.

    A stream that fails or ends is opened again with exponential backoff (a restarted shard comes
    back by itself), except on UNAUTHENTICATED/PERMISSION_DENIED. :meth:`close` cancels every stream.

    Args:
        addresses: ``host:port`` of every shard.
        token: admin token, or empty.
        interval: seconds between statuses of one shard (0.1 to 3600).
        timeout: seconds past ``interval`` a stream may stay silent before it is opened again.
        creds: TLS credentials of the channels; None for plaintext.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        token: str,
        interval: float,
        timeout: float,
        creds: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.addresses = list(addresses)
        self.interval = interval
        self.timeout = timeout
        self.metadata = metadata_of(token)
        self.stop = threading.Event()
        self.changed = threading.Condition()
        self.latest: dict[int, ShardResult] = {}
        self._channels = [channel(a, creds) for a in self.addresses]
        self._threads = [
            threading.Thread(target=self._follow, args=(k,), name=f"ps-admin-watch-{k}", daemon=True)
            for k in range(len(self.addresses))
        ]
        for t in self._threads:
            t.start()

    def _put(self, result: ShardResult) -> None:
        with self.changed:
            self.latest[result.position] = result
            self.changed.notify_all()

    def _follow(self, k: int) -> None:
        stub = ps_pb2_grpc.AdminStub(self._channels[k])
        address = self.addresses[k]
        delays = reconnect_delays(base=min(self.interval, 0.5), cap=max(self.interval, 5.0))
        while not self.stop.is_set():
            try:
                for status in watch(stub, self.interval, metadata=self.metadata, timeout=self.timeout, stop=self.stop):
                    delays = reconnect_delays(base=min(self.interval, 0.5), cap=max(self.interval, 5.0))
                    self._put(ShardResult(k, address, status))
                if self.stop.is_set():
                    return
                ended = "the shard ended the status stream (stopping or restarting); reconnecting"
                self._put(ShardResult(k, address, code=grpc.StatusCode.UNAVAILABLE, details=ended))
            except grpc.RpcError as exc:
                if self.stop.is_set():
                    return
                result = failure(k, address, exc)
                self._put(result)
                if result.code in FATAL:
                    return
            except ValueError:  # the channel was closed under us while stopping
                return
            self.stop.wait(next(delays))

    def wait_all(self, deadline: float) -> None:
        """Block until every shard has answered once or ``deadline`` (monotonic seconds) passes."""
        with self.changed:
            self.changed.wait_for(
                lambda: len(self.latest) == len(self.addresses), timeout=max(0.0, deadline - time.monotonic())
            )

    def snapshot(self) -> list[ShardResult]:
        """One result per address, in ``--servers`` order (``waiting`` for shards not heard yet)."""
        with self.changed:
            return [
                self.latest.get(k, ShardResult(k, a, code=None, details="waiting for the first answer"))
                for k, a in enumerate(self.addresses)
            ]

    def close(self) -> None:
        """Cancel every stream, close the channels and join the threads."""
        self.stop.set()
        for t in self._threads:
            t.join(timeout=_Watchdog.TICK + 1)
        for ch in self._channels:
            ch.close()
