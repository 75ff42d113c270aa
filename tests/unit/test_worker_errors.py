"""ps_worker.errors: typed client errors from gRPC failures (no sockets)."""

from __future__ import annotations

import grpc
import pytest

from ps_common import errors as common
from ps_common.errors import Reason
from ps_worker import errors
from ps_worker.errors import RoundTimeoutError, ShardError, ShardUnreachableError, error_from_rpc, reason_of


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, reason: str = "") -> None:
        self._code, self._details, self._reason = code, details, reason

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return (("ps-reason", self._reason),) if self._reason else ()


def test_wait_timeout_becomes_round_timeout_with_ranks() -> None:
    exc = FakeRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "Version 3 not reached in 2.7 s (shard 0 is at 2; round waits for ranks [1, 3]); check those workers.",
        "WAIT_TIMEOUT",
    )
    err = ShardError.from_rpc("127.0.0.1:50051", exc)
    assert isinstance(err, RoundTimeoutError) and isinstance(err, TimeoutError) and isinstance(err, grpc.RpcError)
    assert err.ranks == [1, 3] and err.reason == "WAIT_TIMEOUT"
    assert str(err).startswith("Shard 127.0.0.1:50051: Version 3")


def test_client_deadline_on_a_wait_is_a_round_timeout_without_ranks() -> None:
    exc = FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    err = ShardError.from_rpc("h:1", exc, waits=True)
    assert isinstance(err, RoundTimeoutError) and err.ranks is None
    assert "ps-admin status" in str(err)
    assert type(ShardError.from_rpc("h:1", exc)) is ShardError  # not a wait: no guess


def test_other_refusals_keep_code_and_reason_and_name_the_shard() -> None:
    err = ShardError.from_rpc("h:1", FakeRpcError(grpc.StatusCode.ABORTED, "too stale", "STALE"))
    assert err.code() == grpc.StatusCode.ABORTED and err.reason == "STALE" and str(err) == "h:1: ABORTED: too stale"
    assert ShardError.from_rpc("h:2", err) is err


def test_unreachable_names_address_and_hint() -> None:
    err = ShardUnreachableError("127.0.0.1:9", grpc.StatusCode.UNAVAILABLE, "Connection refused", 5.0)
    assert str(err).startswith("Shard 127.0.0.1:9 not reachable within 5 s (UNAVAILABLE: Connection refused)")
    assert "is the shard running? check --servers" in str(err)
    # a shard restarting under load can outlast the deadline: the message names the flag to raise (issue 43)
    assert "--retry-deadline (PS_RETRY_DEADLINE)" in str(err)


def test_the_default_retry_deadline_covers_a_shard_restart() -> None:
    """26 s were seen for a shard's restart at a load of 16: the default leaves room for 4 of them."""
    from ps_worker.env import read_env
    from ps_worker.workloads.flags import worker_parser

    assert read_env({"PS_SERVERS": "h:1", "PS_RANK": "0", "PS_NUM_WORKERS": "1"}).retry_deadline == 120.0
    argv = ["--servers", "h:1", "--rank", "0", "--num-workers", "1", "digits"]
    assert worker_parser({}).parse_args(argv).retry_deadline == 120.0


def _server_classes(cls: type[common.PSError] = common.PSError) -> list[type[common.PSError]]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _server_classes(sub))]


@pytest.mark.parametrize("reason", list(Reason))
def test_every_reason_maps_to_its_own_class(reason: Reason) -> None:
    server = {c.reason: c for c in _server_classes()}.get(reason)
    code = grpc.StatusCode[server.code] if server is not None else grpc.StatusCode.RESOURCE_EXHAUSTED
    err = error_from_rpc("h:1", FakeRpcError(code, "refused", reason.value))
    assert isinstance(err, ShardError) and isinstance(err, grpc.RpcError)
    assert err.reason == reason and err.code() == code and err.address == "h:1"
    if reason == Reason.ERROR:  # the base reason: no more specific class
        assert type(err) is ShardError
    else:
        assert type(err).reason == reason and type(err).status == code


def test_the_client_classes_mirror_the_server_hierarchy() -> None:
    for server in _server_classes()[1:]:
        client = type(error_from_rpc("h:1", FakeRpcError(grpc.StatusCode[server.code], "x", server.reason)))
        parent = type(error_from_rpc("h:1", FakeRpcError(grpc.StatusCode.UNKNOWN, "x", server.__base__.reason)))
        assert issubclass(client, parent), (client, parent)
    assert issubclass(errors.WaitTimeout, RoundTimeoutError)  # still caught as before
    assert issubclass(errors.Replayed, errors.StalePush) and issubclass(errors.JoinTimeout, errors.PreconditionFailed)


def test_unknown_reasons_and_plain_failures_stay_shard_errors() -> None:
    err = error_from_rpc("h:1", FakeRpcError(grpc.StatusCode.INTERNAL, "new", "SOMETHING_NEW"))
    assert type(err) is ShardError and err.reason == "SOMETHING_NEW"
    assert type(error_from_rpc("h:1", FakeRpcError(grpc.StatusCode.UNAVAILABLE, "down"))) is ShardError
    assert reason_of(ValueError("no metadata")) == ""


def test_recoverable_refusals_are_the_session_s() -> None:
    assert set(errors.RECOVERABLE) == {errors.NotJoined, errors.NotInitialized, errors.FutureRound, errors.PushLost}
