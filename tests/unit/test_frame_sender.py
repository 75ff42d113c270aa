"""The order of a PushPull's frames across shards (ps_worker/transport/frame_sender.py): slot by slot over the
shards, a sender that ends gives up its turns, and the order is a schedule only (a turn that never
comes is waited for a bounded time)."""

from __future__ import annotations

import threading
import time

import torch

from ps_worker.transport.data_link import DataLinkError
from ps_worker.transport.frame_sender import FrameSender, SendOrder

TIMEOUT = 30.0


class FakeConnection:
    """Records (shard, slot) of each partition sent, in the order the senders hand them over."""

    def __init__(self, k: int, log: list[tuple[int, int]], lock: threading.Lock, fail_at: int = -1) -> None:
        self.k, self.log, self.lock, self.fail_at = k, log, lock, fail_at
        self.timeout = TIMEOUT
        self.ended = False

    def send_slot(self, sequence: int, slot: int, values: torch.Tensor) -> int:
        if slot == self.fail_at:
            raise DataLinkError("the connection broke")
        with self.lock:
            self.log.append((self.k, slot))
        return values.numel() * values.element_size()

    def send_end(self, sequence: int, count: int) -> int:
        self.ended = True
        return 24


def senders(counts: dict[int, int], order: SendOrder | None, fail: dict[int, int] | None = None):
    log: list[tuple[int, int]] = []
    lock = threading.Lock()
    conns = {k: FakeConnection(k, log, lock, (fail or {}).get(k, -1)) for k in counts}
    # started in reverse shard order: without the order, shard 2 would go first
    started = [
        FrameSender(conns[k], 7, n, lambda i: (i, torch.zeros(4)), order, k)  # type: ignore[arg-type]
        for k, n in sorted(counts.items(), reverse=True)
    ]
    return started, conns, log


def test_frames_go_out_slot_by_slot_over_the_shards() -> None:
    counts = {0: 3, 1: 2, 2: 3}
    started, conns, log = senders(counts, SendOrder(counts))
    assert [s.join() for s in started] == [3 * 16 + 24, 2 * 16 + 24, 3 * 16 + 24]
    assert log == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 2), (2, 2)]
    assert all(c.ended for c in conns.values())


def test_a_sender_that_fails_gives_up_its_turns_and_the_others_go_on_at_once() -> None:
    counts = {0: 4, 1: 4}
    start = time.monotonic()
    started, conns, log = senders(counts, SendOrder(counts), fail={0: 1})
    errors = []
    for s in started:
        try:
            s.join()
        except DataLinkError as exc:
            errors.append(exc.details())
    assert errors == ["the connection broke"]
    assert log == [(0, 0), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert time.monotonic() - start < TIMEOUT / 2  # nobody waited out a turn that never came
    assert conns[1].ended and not conns[0].ended


def test_a_shard_outside_the_order_and_one_that_gives_up_hold_nobody() -> None:
    order = SendOrder({0: 2, 1: 2})
    order.give_up(0)  # its push went on gRPC
    started, _, log = senders({1: 2, 5: 1}, order)  # shard 5 takes no turns
    for s in started:
        s.join()
    assert sorted(log) == [(1, 0), (1, 1), (5, 0)]


def test_a_turn_that_never_comes_is_waited_for_a_bounded_time() -> None:
    order = SendOrder({0: 1, 1: 1})
    start = time.monotonic()
    order.wait(1, 0, timeout=0.2)  # shard 0 never sends: shard 1 goes on out of order
    assert 0.15 <= time.monotonic() - start < TIMEOUT


def test_without_an_order_each_frame_goes_at_once() -> None:
    started, _, log = senders({0: 2, 1: 2}, None)
    for s in started:
        s.join()
    assert sorted(log) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_frames_begun_during_backward_go_out_in_the_order_their_gradients_are_ready() -> None:
    # a push begun during backward: shard 1's slot 1 is ready first, then shard 0's slot 0, then
    # shard 1's slot 0 (backward's order, not the slots')
    order = SendOrder()
    ready = {0: [0], 1: [1, 0]}
    for k in (1, 0, 1):
        order.add(k)
    log: list[tuple[int, int]] = []
    lock = threading.Lock()
    conns = {k: FakeConnection(k, log, lock) for k in (0, 1)}
    # shard 0's sender starts first: without the order, its partition would go first
    started = [
        FrameSender(conns[k], 7, len(ready[k]), lambda i, k=k: (ready[k][i], torch.zeros(4)), order, k)  # type: ignore[arg-type]
        for k in (0, 1)
    ]
    assert [s.join() for s in started] == [16 + 24, 2 * 16 + 24]
    assert log == [(1, 1), (0, 0), (1, 0)]


def test_a_turn_added_for_a_shard_that_gave_up_holds_nobody() -> None:
    order = SendOrder()
    order.add(0)
    order.give_up(0)  # its frame failed during backward
    order.add(0)  # a later gradient of the same shard: passed at once
    order.add(1)
    start = time.monotonic()
    order.wait(1, 0, timeout=TIMEOUT)
    assert time.monotonic() - start < TIMEOUT / 2
