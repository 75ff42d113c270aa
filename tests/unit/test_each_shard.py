"""``Transport.each_shard``: one call per shard in parallel, shard 0 in the calling thread, results
in shard order, and the first error in shard order raised once every call has ended."""

from __future__ import annotations

import threading

import pytest

from ps_worker.transport.grpc_link import Transport

TIMEOUT = 10.0


def transport(num_shards: int) -> Transport:
    # channels connect lazily: nothing listens at these addresses, and nothing dials them here
    return Transport([f"127.0.0.1:{9 + k}" for k in range(num_shards)], 1 << 20)


def test_shard_zero_runs_in_the_calling_thread_and_the_others_in_parallel() -> None:
    t = transport(3)
    try:
        started = threading.Barrier(3, timeout=TIMEOUT)  # all three run at once, or this times out
        threads: dict[int, int] = {}

        def fn(k: int) -> int:
            threads[k] = threading.get_ident()
            started.wait()
            return k * 10

        assert t.each_shard(fn) == [0, 10, 20]
        assert threads[0] == threading.get_ident() and len(set(threads.values())) == 3
    finally:
        t.close()


def test_the_first_error_in_shard_order_is_raised_after_every_call_ended() -> None:
    t = transport(3)
    try:
        started = threading.Barrier(3, timeout=TIMEOUT)
        ended: list[int] = []

        def fn(k: int) -> int:
            started.wait()  # the others are running when shard 0 fails
            if k == 0:
                raise ValueError("shard 0")
            ended.append(k)
            if k == 2:
                raise KeyError("shard 2")
            return k

        with pytest.raises(ValueError, match="shard 0"):
            t.each_shard(fn)
        assert sorted(ended) == [1, 2]  # the others had ended when it was raised
        with pytest.raises(KeyError, match="shard 2"):
            t.each_shard(lambda k: k if k < 2 else {}["shard 2"])
    finally:
        t.close()
