"""CPU cost of each step a partition goes through in grpc-ps, one process, no network.

    python bench/wire_costs.py [--sizes 262144,1048576,4194304] [--repeats 30]

Times, for one float32 partition, every copy and pass the data path makes today (the calls of
``ps_worker/client.py``, ``ps_server/service/parameters.py``, ``ps_server/service/call_metrics.py`` and the codec),
and prints each as microseconds and as multiples of one plain memcpy of the same bytes. Stages
are timed in alternation, repeat after repeat; medians are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from ps_common.codec import check_finite, decode
from ps_proto.v1 import ps_pb2


def encode(flat: torch.Tensor) -> bytes:
    """Raw bytes of a 1-D CPU tensor, ``tensor.numpy().tobytes()``: the copy the protobuf path makes
    (grpc-ps itself copies once, from the tensor into the message: ``ps_common.frames.build``)."""
    return flat.contiguous().view(torch.uint8).numpy().tobytes()


def stages(nbytes: int) -> dict[str, Callable[[], object]]:
    """name -> a call doing that stage once on a partition of ``nbytes``."""
    n = nbytes // 4
    flat = torch.randn(n) * 1e-3
    out = torch.empty(n)
    src, dst = flat.numpy(), np.empty(n, np.float32)
    data = encode(flat)
    part = ps_pb2.Partition(key="w", offset=0, length=n, dtype=ps_pb2.DTYPE_FLOAT32, data=data)
    req = ps_pb2.PushRequest(partition=part)
    wire = req.SerializeToString()
    parsed = ps_pb2.PushRequest.FromString(wire)
    resp = ps_pb2.PullResponse(version=1, partition=part)
    resp_wire = resp.SerializeToString()
    got = ps_pb2.PullResponse.FromString(resp_wire)
    view = decode(data, "float32", n)
    return {
        "memcpy (numpy copyto), reference": lambda: np.copyto(dst, src),
        "client: encode() = tensor.numpy().tobytes()": lambda: encode(flat),
        "client: Partition(data=...) + PushRequest": lambda: ps_pb2.PushRequest(
            partition=ps_pb2.Partition(key="w", offset=0, length=n, dtype=ps_pb2.DTYPE_FLOAT32, data=data)
        ),
        "grpc: SerializeToString (send)": req.SerializeToString,
        "server: PushRequest.FromString (receive)": lambda: ps_pb2.PushRequest.FromString(wire),
        "server: ByteSize() of a parsed message": parsed.ByteSize,
        "server: msg.partition.data (bytes out of upb)": lambda: parsed.partition.data,
        "server: check_finite (t . t, exact check if not finite)": lambda: check_finite(view, "g"),
        "server: aggregate clone (sync round)": lambda: view.clone(),
        "server: snapshot encode() for a pull": lambda: encode(flat),
        "server: PullResponse(partition=Partition(data))": lambda: ps_pb2.PullResponse(
            version=1,
            partition=ps_pb2.Partition(key="w", offset=0, length=n, dtype=ps_pb2.DTYPE_FLOAT32, data=data),
        ),
        "server: ByteSize() of a built response": resp.ByteSize,
        "grpc: SerializeToString (pull response)": resp.SerializeToString,
        "client: PullResponse.FromString": lambda: ps_pb2.PullResponse.FromString(resp_wire),
        "client: decode(p.data) + copy_ into the weights": lambda: out.copy_(decode(got.partition.data, "float32", n)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=f"{256 << 10},{1 << 20},{4 << 20}", help="partition bytes, comma-separated")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    for nbytes in (int(x) for x in args.sizes.split(",")):
        calls = stages(nbytes)
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(args.repeats):
            for name, call in calls.items():  # alternating: every stage once per repeat
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        ref = statistics.median(times["memcpy (numpy copyto), reference"])
        print(f"\npartition of {nbytes} bytes ({nbytes >> 10} KiB), median of {args.repeats}")
        print(f"  {'stage':<52} {'µs':>9} {'x memcpy':>9}")
        for name, samples in times.items():
            med = statistics.median(samples)
            print(f"  {name:<52} {med * 1e6:>9.0f} {med / ref:>9.1f}")


if __name__ == "__main__":
    main()
