"""Shard addresses are checked before any connection: one parser for ps-worker, ps-admin and PSClient."""

from __future__ import annotations

import pytest

from ps_common.channels import parse_address, parse_servers


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:50051", ("127.0.0.1", 50051)),
        (" ps-0.ps:1 ", ("ps-0.ps", 1)),
        ("localhost:65535", ("localhost", 65535)),
        ("[::1]:50051", ("::1", 50051)),
    ],
)
def test_well_formed_addresses_parse(address: str, expected: tuple[str, int]) -> None:
    assert parse_address(address) == expected


@pytest.mark.parametrize(
    ("address", "complaint"),
    [
        ("127.0.0.1:", "no port after ':'"),
        ("127.0.0.1", "has no port"),
        ("host:notaport", "'notaport', which is not a number"),
        ("host:0", "outside 1..65535"),
        ("host:65536", "outside 1..65535"),
        ("host:-1", "not a number"),
        (":50051", "no host"),
        ("::1:50051", "IPv6 without brackets"),
        ("[::1:50051", "unclosed IPv6 bracket"),
        ("host:５０", "not a number"),
    ],
)
def test_malformed_addresses_are_refused_by_name(address: str, complaint: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_address(address)
    assert repr(address) in str(info.value) and complaint in str(info.value)
    assert "HOST:PORT" in str(info.value)


def test_servers_are_split_checked_and_kept_in_order() -> None:
    assert parse_servers(" a:1, b:2 ,,") == ["a:1", "b:2"]
    assert parse_servers(["a:1", "unix:/tmp/ps.sock"]) == ["a:1", "unix:/tmp/ps.sock"]
    with pytest.raises(ValueError, match=r"--servers: Shard address 'b:' has no port"):
        parse_servers("a:1,b:")
    with pytest.raises(ValueError, match="--servers needs at least one shard address"):
        parse_servers(" , ")
