"""ps_worker.errors: the shard's own error classes (ps_common.errors) raised again from gRPC failures (no sockets)."""

from __future__ import annotations

import grpc
import pytest

from ps_common import errors as common
from ps_common.errors import PSError, Reason, RoundTimeoutError, reason_of
from ps_worker import errors
from ps_worker.errors import ShardUnreachableError, error_from_rpc


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
    err = error_from_rpc("127.0.0.1:50051", exc)
    assert isinstance(err, RoundTimeoutError) and isinstance(err, TimeoutError) and isinstance(err, grpc.RpcError)
    assert err.ranks == [1, 3] and err.reason == "WAIT_TIMEOUT"
    assert str(err).startswith("Shard 127.0.0.1:50051: Version 3")


def test_client_deadline_on_a_wait_is_a_round_timeout_without_ranks() -> None:
    exc = FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    err = error_from_rpc("h:1", exc, waits=True)
    assert isinstance(err, RoundTimeoutError) and err.ranks is None
    assert "ps-admin status" in str(err)
    assert type(error_from_rpc("h:1", exc)) is PSError  # not a wait: no guess


def test_other_refusals_keep_code_and_reason_and_name_the_shard() -> None:
    err = error_from_rpc("h:1", FakeRpcError(grpc.StatusCode.ABORTED, "too stale", "STALE"))
    assert err.code() == grpc.StatusCode.ABORTED and err.reason == "STALE" and str(err) == "h:1: ABORTED: too stale"
    assert error_from_rpc("h:2", err) is err
    assert isinstance(err, common.StalePushError) and err.address == "h:1" and err.details() == "too stale"


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


def _classes(cls: type[PSError] = PSError) -> list[type[PSError]]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _classes(sub))]


@pytest.mark.parametrize("reason", list(Reason))
def test_every_reason_is_raised_as_the_shard_s_own_class(reason: Reason) -> None:
    server = {c.reason: c for c in _classes() if c.__module__ == common.__name__ and "reason" in vars(c)}[reason]
    err = error_from_rpc("h:1", FakeRpcError(server.status, "refused", reason.value))
    assert type(err) is server and isinstance(err, grpc.RpcError)  # one class for both sides
    assert err.reason == reason and err.code() == server.status and err.address == "h:1"
    text = f"h:1: {server.status.name}: refused"
    assert err.details() == "refused" and (str(err) == text or issubclass(server, RoundTimeoutError))


def test_raised_by_the_shard_a_class_answers_as_a_call_does() -> None:
    err = common.NotJoinedError("rank 1 is not joined: Join again")
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.reason == Reason.NOT_JOINED and err.details() == str(err) == "rank 1 is not joined: Join again"
    assert err.address == "" and err.trailing_metadata() == () and reason_of(err) == ""
    assert issubclass(common.WaitTimeoutError, RoundTimeoutError) and issubclass(RoundTimeoutError, TimeoutError)


def test_the_old_worker_names_are_aliases_of_the_shared_classes() -> None:
    assert errors.ShardError is PSError and errors.NotJoined is common.NotJoinedError
    assert errors.WaitTimeout is common.WaitTimeoutError and errors.AwaitingRanks is common.AwaitingRanksError
    assert errors.JoinTimeout is common.RanksMissingError and errors.TableFull is common.TableFullError
    assert errors.RoundTimeoutError is RoundTimeoutError
    for name in errors.__all__:
        value = getattr(errors, name)
        assert not isinstance(value, type) or value.__module__ in (common.__name__, errors.__name__), name


def test_unknown_reasons_and_plain_failures_stay_shard_errors() -> None:
    err = error_from_rpc("h:1", FakeRpcError(grpc.StatusCode.INTERNAL, "new", "SOMETHING_NEW"))
    assert type(err) is PSError and err.reason == "SOMETHING_NEW"
    assert type(error_from_rpc("h:1", FakeRpcError(grpc.StatusCode.UNAVAILABLE, "down"))) is PSError
    assert reason_of(ValueError("no metadata")) == ""


def test_recoverable_refusals_are_the_session_s() -> None:
    assert set(errors.RECOVERABLE) == {
        common.NotJoinedError,
        common.NotInitializedError,
        common.FutureRoundError,
        common.PushLostError,
    }
