"""Where the busy time of a py-spy raw profile goes, in the data path's own categories.

    python bench/profile_summary.py worker.txt shard0.txt

Reads ``py-spy record --native -f raw`` output (collapsed stacks with counts), drops samples of
threads that are waiting (locks, epoll, condition variables, blocking socket calls), and charges
each busy sample to the category whose marker appears deepest in its stack (see :data:`CATEGORIES`).
"""

from __future__ import annotations

import argparse
import collections
import re

IDLE = (
    "PyThread_acquire_lock_timed",
    "epoll_wait",
    "pthread_cond_timedwait",
    "pthread_cond_wait",
    "sem_wait",
    "sem_timedwait",
    "do_futex_wait",
    "Child._read",
    "clock_nanosleep",
    "Session._beat",
)
"""Markers of a waiting thread."""

WAITING_CALLS = ("recv (libc", "recvfrom (libc", "accept4 (libc", "accept (libc", "poll (libc", "select (libc")
"""A sample whose innermost frame is one of these blocking socket calls counts as waiting too (a
data connection's thread waiting for the peer's next bytes, a listener for a connection). With a
large payload part of that time is the kernel copying received bytes, which "sockets" then counts
short: read those profiles with this in mind."""

CATEGORIES = (
    ("optimizer step (torch.optim, its finiteness proof)", ("torch/optim", "ParameterStore._apply", "stays_finite")),
    ("round: aggregate, close, hyperparameters, version", ("aggregate", "ps_server/policy/")),
    ("check_finite of received gradients (dot product; exact check if not finite)", ("check_finite",)),
    (
        "shard: snapshot frames (one copy, cast to the wire dtype)",
        ("response_frames", "_snapshot_frames", "FrameCache"),
    ),
    ("frames: build (the one copy of each payload sent)", ("build (ps_common/frames.py", "build_chunks")),
    ("frames: read (parse, zero-copy views)", ("read (ps_common/frames.py", "fields (ps_common/frames.py")),
    ("ByteSize(): a full re-serialization", ("PyUpb_Message_ByteSize",)),
    ("protobuf: build Partition + wrap in request/response", ("PyUpb_Message_InitAttributes", "MergeFrom")),
    ("protobuf: SerializeToString for gRPC", ("PyUpb_Message_SerializeInternal", "SerializeToString")),
    ("protobuf: parse (FromString) and .data", ("upb_Decode", "FromString", "PyUpb_Message_GetFieldValue")),
    ("encode(): tensor -> bytes", ("array_tobytes", "codec.py)")),
    (
        "sockets: sendmsg / recvmsg / read / write",
        ("sendmsg", "recvmsg", "read (libc", "write (libc", "writev", "recv ("),
    ),
    ("gRPC core and Python gRPC machinery", ("cygrpc", "grpc/_server.py", "grpc/_channel.py", "grpc/_common.py")),
    ("worker: copy received values into the weights", ("WireCodec.decode (",)),
    ("worker: stage/cast gradients, top-k", ("WireCodec.to_wire (", "TopK.compress (")),
    ("shard: call metrics (prometheus-client)", ("prometheus_client", "call_metrics")),
    ("shard: request checks (header, session, partitions)", ("ps_server/core/", "request_streams", "check_request")),
    ("shard: membership, waits, counters", ("ps_server/membership/", "ps_server/shard/waits", "counters.py")),
    ("shard: other request handling (servicer, data path, calls)", ("ps_server/",)),
    ("thread pools, locks and conditions", ("concurrent/futures", "threading.py")),
    ("worker: session, retries, accounting", ("ps_worker/session", "retry.py", "awaiting", "redo.py", "relay.py")),
    ("PSClient bookkeeping: plan lookups, staging, dicts", ("ps_worker/",)),
)
"""Each busy sample goes to the category whose marker sits deepest in its stack (below the thread's
entry, ``Thread.run``): what a wrapper (call metrics, retries) runs is charged to what it runs."""


def _category(frames: list[str]) -> str:
    """The category with a marker in the deepest frame (in one frame, the first of :data:`CATEGORIES`)."""
    for frame in reversed(frames):
        for name, markers in CATEGORIES:
            if any(m in frame for m in markers):
                return name
    return "other"


def summarize(path: str) -> tuple[int, int, collections.Counter[str]]:
    """(all samples, busy samples, busy samples per category)."""
    per: collections.Counter[str] = collections.Counter()
    total = busy = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            n = int(count)
            total += n
            if any(marker in stack for marker in IDLE) or stack.rpartition(";")[2].startswith(WAITING_CALLS):
                continue
            busy += n
            stack = re.sub(r"0x[0-9a-f]+ ", "", stack).rpartition("Thread.run (threading.py")[2]
            per[_category(stack.split(";"))] += n
    return total, busy, per


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profiles", nargs="+")
    args = p.parse_args()
    for path in args.profiles:
        total, busy, per = summarize(path)
        print(f"{path}: {busy} busy of {total} samples")
        for name, n in per.most_common():
            print(f"  {100 * n / max(1, busy):5.1f}%  {name}")


if __name__ == "__main__":
    main()
