"""Container health check: ask a shard's ``grpc.health.v1.Health`` and exit 0 only when SERVING.

Run as ``python -m ps_server.healthcheck [HOST:PORT]`` from a Docker ``HEALTHCHECK`` or a
compose ``healthcheck``. The address defaults to ``127.0.0.1:$PS_PORT`` (50051 when unset), the
shard's own port seen from inside its container. Health stays open without tokens (docs/architecture.md#8-security),
so the check needs none. It imports only the standard library and grpcio (never torch), so it
starts in a fraction of a second.

Exit codes: 0 SERVING; 1 anything else (NOT_SERVING, unknown service, unreachable, timed out);
2 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_PORT = 50051


def default_address() -> str:
    """``127.0.0.1:$PS_PORT``, or ``127.0.0.1:50051`` when ``PS_PORT`` is unset or 0."""
    port = os.environ.get("PS_PORT", "").strip()
    return f"127.0.0.1:{port if port not in ('', '0') else DEFAULT_PORT}"


def check(address: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """Ask ``address`` whether ``service`` is serving.

    Args:
        address: ``host:port`` of a shard.
        service: health service name; ``""`` is the whole server.
        timeout: deadline of the call in seconds.

    Returns:
        ``(serving, text)``: whether the answer was SERVING, and a one-line description.
    """
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return False, f"{address} {service or '(server)'}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address} {service or '(server)'}: {status}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; prints one line and returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m ps_server.healthcheck", description="Exit 0 when a grpc-ps shard reports SERVING."
    )
    parser.add_argument(
        "address", nargs="?", default=None, help="HOST:PORT of the shard (default 127.0.0.1:$PS_PORT, or :50051)"
    )
    parser.add_argument("--service", default="", help="health service name (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="deadline of the check in seconds")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}.")
    serving, text = check(args.address or default_address(), args.service, args.timeout)
    print(text, file=sys.stdout if serving else sys.stderr, flush=True)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
