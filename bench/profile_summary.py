"""Where the busy time of a py-spy raw profile goes, in the data path's own categories.

    python bench/profile_summary.py worker.txt shard0.txt

Reads ``py-spy record --native -f raw`` output (collapsed stacks with counts), drops samples of
threads that are waiting (locks, epoll, condition variables), and charges each busy sample to the
first category whose marker appears in its stack (see :data:`CATEGORIES`, most specific first).
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

CATEGORIES = (
    ("check_finite of received gradients (dot product; exact check if not finite)", ("check_finite",)),
    ("shard: snapshot frames (one copy, cast to the wire dtype)", ("response_frames", "_snapshot_frames")),
    ("frames: build (the one copy of each payload sent)", ("build (ps_common/frames.py",)),
    ("frames: read (parse, zero-copy views)", ("read (ps_common/frames.py", "fields (ps_common/frames.py")),
    ("sync round: aggregate + optimizer step", ("aggregate", "ParameterStore.apply", "optimizer")),
    ("ByteSize(): a full re-serialization", ("PyUpb_Message_ByteSize",)),
    ("protobuf: build Partition + wrap in request/response", ("PyUpb_Message_InitAttributes", "MergeFrom")),
    ("protobuf: SerializeToString for gRPC", ("PyUpb_Message_SerializeInternal", "SerializeToString")),
    ("protobuf: parse (FromString) and .data", ("upb_Decode", "FromString", "PyUpb_Message_GetFieldValue")),
    ("encode(): tensor -> bytes", ("array_tobytes", "codec.py)")),
    ("sockets: sendmsg / recvmsg / read / write", ("sendmsg", "recvmsg", "read (libc", "write (libc", "writev")),
    ("gRPC core and Python gRPC machinery", ("cygrpc", "grpc/_server.py", "grpc/_channel.py", "grpc/_common.py")),
    ("worker: copy received values into the weights", ("WireCodec.decode (",)),
    ("worker: stage/cast gradients, top-k", ("WireCodec.to_wire (", "TopK.compress (")),
    ("thread pools and futures", ("concurrent/futures", "threading.py")),
    ("PSClient bookkeeping: plan lookups, staging, dicts", ("ps_worker/",)),
)


def summarize(path: str) -> tuple[int, int, collections.Counter[str]]:
    """(all samples, busy samples, busy samples per category)."""
    per: collections.Counter[str] = collections.Counter()
    total = busy = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            n = int(count)
            total += n
            if any(marker in stack for marker in IDLE):
                continue
            busy += n
            stack = re.sub(r"0x[0-9a-f]+ ", "", stack)
            for name, markers in CATEGORIES:
                if any(m in stack for m in markers):
                    per[name] += n
                    break
            else:
                per["other"] += n
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
