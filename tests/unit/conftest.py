"""Unit tests exercise the pure core: any attempt to open a socket fails the test."""

from __future__ import annotations

import socket

import pytest


class SocketOpened(AssertionError):
    pass


@pytest.fixture(autouse=True)
def no_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise SocketOpened("a unit test of the pure core tried to open a socket")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
