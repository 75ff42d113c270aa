"""ps_worker.transport.request_frames.StartedStream: a push begun during backward (overlap) keeps its
last message until step() finishes it, so a push abandoned before step() never reaches a shard whole."""

from __future__ import annotations

import threading

import pytest

from ps_worker.transport.request_frames import StartedStream

WAIT = 0.2  # seconds StartedStream waits for the next message before it fails the call


def _stream(groups: int) -> StartedStream:
    return StartedStream(threading.Condition(), [[i] for i in range(groups)], timeout=WAIT)


def test_the_last_message_waits_for_finish() -> None:
    stream = _stream(2)
    stream.add([0], b"m0")
    stream.add([1], b"m1")  # every message built during backward
    messages = stream.messages()
    assert next(messages) == b"m0"
    with pytest.raises(RuntimeError, match="did not come within"):
        next(messages)  # m1 is held back; with no step() the call fails instead of ending whole


def test_finish_sends_the_last_message_and_ends_the_stream() -> None:
    stream = _stream(2)
    stream.add([0], b"m0")
    stream.add([1], b"m1")
    stream.finish()
    assert list(stream.messages()) == [b"m0", b"m1"]


def test_a_message_goes_while_later_ones_are_still_unbuilt() -> None:
    stream = _stream(3)
    stream.add([0], b"m0")
    messages = stream.messages()
    assert next(messages) == b"m0"  # groups 1 and 2 still to come: m0 is not the last
    stream.add([1], b"m1")
    assert next(messages) == b"m1"  # group 2 still unbuilt
    stream.add([2], b"m2")
    stream.finish()
    assert list(messages) == [b"m2"]


def test_an_abandoned_push_fails_its_stream_with_the_last_message_unsent() -> None:
    stream = _stream(2)
    stream.add([0], b"m0")
    stream.add([1], b"m1")
    messages = stream.messages()
    assert next(messages) == b"m0"
    stream.abort()
    with pytest.raises(RuntimeError, match="abandoned"):
        next(messages)
