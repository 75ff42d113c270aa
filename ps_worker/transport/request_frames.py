"""A push's request messages for gRPC: built from its partitions (:func:`frames_of`), or handed
to gRPC's sending thread one by one as backward makes them (:class:`StartedStream`, pushes
started during backward: ``overlap=True``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from ps_common import frames


def frames_of(
    work: list[list[frames.OutPartition]], head: bytes, sent: Callable[[bytes], bytes], counts: list[int], k: int
) -> Iterator[bytes]:
    """Build and yield one message per group of ``work``, ``head`` leading the first. The
    generator runs in gRPC's sending thread and lets go of each group once built, so that thread
    never holds the last reference to a tensor: a thread that frees a tensor while it exits during
    interpreter shutdown aborts the process (seen with a thread-local of the shard's interceptor)."""
    while work:
        m = sent(frames.build(work.pop(0), head))
        head = b""
        counts[k] += len(m)
        yield m


class StartedStream:
    """A started PushPull stream: the frames :meth:`PendingPushPull.ready` builds, handed to
    gRPC's sending thread as they come. Holds bytes and indices only, never tensors (see
    :func:`frames_of`)."""

    def __init__(self, cond: threading.Condition, groups: list[list[int]], timeout: float) -> None:
        self.cond = cond
        self.unbuilt = groups
        self.built: list[bytes] = []
        self.finished = False
        self.aborted = False
        self.timeout = timeout

    def add(self, group: list[int], frame: bytes) -> None:
        with self.cond:
            self.unbuilt.remove(group)
            self.built.append(frame)
            self.cond.notify_all()

    def finish(self) -> None:
        with self.cond:
            self.finished = True
            self.cond.notify_all()

    def abort(self) -> None:
        """Fail the stream instead of ending it: the shard sees a cancelled call, never a push."""
        with self.cond:
            self.aborted = True
            self.cond.notify_all()

    def messages(self) -> Iterator[bytes]:
        # The last message goes out only at finish() (the step), even when it was built during
        # backward: until then the push can still be abandoned (abort) and the shard applies nothing.
        # Ending the stream there is not enough: a gRPC server may read a cancelled request stream
        # as one that ended (its last receive completes empty before the cancellation is seen), and
        # a shard takes a push whose partitions all arrived. Without the last message it has not.
        def sendable() -> bool:
            return self.aborted or self.finished or len(self.built) > 1 or bool(self.built and self.unbuilt)

        while True:
            with self.cond:
                in_time = self.cond.wait_for(sendable, timeout=self.timeout)
                if self.aborted:
                    raise RuntimeError("push abandoned before step()")  # gRPC cancels the call
                if not in_time:
                    raise RuntimeError(f"step() did not come within {self.timeout} s of the last gradient")
                if not self.built:
                    return  # finished: every message went out
                m = self.built.pop(0)
            yield m
