"""The errors :class:`~ps_worker.PSClient` raises when a shard refuses a call or cannot be reached.

Each is a ``grpc.RpcError`` (``.code()``, ``.details()``, ``.trailing_metadata()`` as gRPC's own), so
code that branches on ``.code()`` keeps working; they add the shard's address, and the subclasses
say what went wrong in words a user can act on::

    ShardError                 a shard refused a call (any status code); .address, .reason
    ├── ShardUnreachableError  no answer from a shard within --retry-deadline (not running, wrong address)
    └── RoundTimeoutError      a sync round / SSP read did not complete in time; .ranks it waits for
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import grpc

HINT_UNREACHABLE = "is the shard running? check --servers (and --tls-ca if the shards serve TLS)"

_RANKS = re.compile(r"waits for ranks \[([0-9, ]*)\]")


def _reason(exc: grpc.RpcError) -> str:
    try:
        metadata = exc.trailing_metadata() or ()
    except (AttributeError, ValueError):
        return ""
    return next((str(v) for key, v in metadata if key == "ps-reason"), "")


class ShardError(grpc.RpcError):
    """A call to the shard at ``address`` failed after retries and recoveries.

    Attributes:
        address: ``host:port`` of the shard, as given in ``servers``.
        reason: the shard's ``ps-reason`` (``NOT_JOINED``, ``STALE``, ``WAIT_TIMEOUT``, …), "" when none.
    """

    def __init__(
        self,
        address: str,
        code: grpc.StatusCode,
        details: str,
        metadata: Sequence[tuple[str, str]] = (),
        message: str | None = None,
    ) -> None:
        self.address = address
        self._code = code
        self._details = details
        self._metadata = tuple(metadata)
        self.reason = next((str(v) for key, v in self._metadata if key == "ps-reason"), "")
        super().__init__(message or f"{address}: {code.name}: {details}")

    @classmethod
    def from_rpc(cls, address: str, exc: grpc.RpcError, waits: bool = False) -> ShardError:
        """The typed error of ``exc``, a failed call to ``address`` (returned as is when already typed);
        ``waits``: the call may wait for a round (Pull, PushPull, Exchange), so a deadline without the
        shard's reason is a :class:`RoundTimeoutError` too."""
        if isinstance(exc, ShardError):
            return exc
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = (exc.details() if hasattr(exc, "details") else str(exc)) or ""
        try:
            metadata = tuple(exc.trailing_metadata() or ())
        except (AttributeError, ValueError):
            metadata = ()
        reason = _reason(exc)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and reason == "WAIT_TIMEOUT":
            return RoundTimeoutError(address, code, details, metadata)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and not reason and waits:
            # the client's own deadline: the shard did not say why (it answers before that deadline
            # when a round or an SSP read keeps it waiting)
            return RoundTimeoutError(address, code, details, metadata)
        return cls(address, code, details, metadata)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


class ShardUnreachableError(ShardError):
    """No answer from the shard at ``address`` within ``seconds`` (``--retry-deadline``): nothing
    listens there, the address is wrong, or a firewall drops the connection."""

    def __init__(self, address: str, code: grpc.StatusCode, details: str, seconds: float) -> None:
        self.seconds = seconds
        super().__init__(
            address,
            code,
            details,
            message=(
                f"Shard {address} not reachable within {seconds:g} s ({code.name}: {details}); {HINT_UNREACHABLE}."
            ),
        )


class RoundTimeoutError(ShardError, TimeoutError):
    """A wait at the shard ran past the call's deadline: a sync round (or an SSP read) waits for
    ranks that did not push. ``ranks`` lists them when the shard said which (else None); check
    those workers, or ``ps-admin evict RANK`` one that is gone."""

    def __init__(
        self, address: str, code: grpc.StatusCode, details: str, metadata: Sequence[tuple[str, str]] = ()
    ) -> None:
        found = _RANKS.search(details or "")
        self.ranks: list[int] | None = (
            [int(r) for r in found.group(1).replace(" ", "").split(",") if r] if found else None
        )
        if self.ranks is not None:
            text = f"Shard {address}: {details}"
        else:
            text = (
                f"Shard {address} did not answer in time ({details or code.name}); a sync round or SSP read may "
                "wait for a worker that is gone (ps-admin status shows which), or raise the timeout."
            )
        super().__init__(address, code, details, metadata, message=text)
