"""The cost of OpenTelemetry tracing: a small model's sync steps/s with tracing off, off without the
``opentelemetry`` packages, and on at 1 % and 100 % sampling.

    python bench/tracing_cost.py --steps 200 --rounds 5

Each configuration is a cluster of its own (``--shards`` ``ps-server`` processes and one worker
process, sync, the digits MLP of 9,610 parameters, batch 32), all alive at once; rounds alternate
the configurations A B C D … so that a change of the machine's load hits them alike. Tracing on
exports to an OTLP/gRPC collector in this process (``--otel-endpoint`` through ``PS_OTEL_ENDPOINT``
on shards and worker; ``OTEL_TRACES_SAMPLER=parentbased_traceidratio``, ``OTEL_TRACES_SAMPLER_ARG``).
"Without the packages" puts a directory first on ``PYTHONPATH`` whose ``opentelemetry`` cannot be
imported. Prints the median steps/s of each, its ratio to "off" (and the ratio's per-round range),
the spans received, and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
from concurrent import futures
from pathlib import Path

from _common import Child, child_env, cpu_seconds, start_shards, stop_all

CONFIGS = {
    "off": {},
    "off, opentelemetry not installed": {"_block": "1"},
    "on, 1 % sampled": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"},
    "on, every step sampled": {"OTEL_TRACES_SAMPLER": "parentbased_always_on"},
}


def collector() -> tuple[object, str, list[int]]:
    """An OTLP/gRPC trace collector on 127.0.0.1:0 that counts spans: (server, url, [count])."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    count = [0]
    lock = threading.Lock()

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802
            with lock:
                count[0] += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"http://127.0.0.1:{port}", count


def worker(servers: str) -> None:
    """The child: train the MLP through ``servers`` and answer ``run`` with each step's seconds."""
    import torch
    import torch.nn.functional as F
    from _common import serve, timed

    from ps_common import tracing
    from ps_worker import DistributedOptimizer, PSClient

    tracing.configure(os.environ.get("PS_OTEL_ENDPOINT", ""), "ps-worker", {"ps.rank": 0})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    client = PSClient(servers.split(","), 0, 1, timeout=300)
    client.init(model, {"name": "sgd", "lr": 0.01})
    opt = DistributedOptimizer(model, client)

    def step() -> None:
        with tracing.span("step"):  # what ps-worker's training loop does (ps_worker/workloads/train.py)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

    print('{"ready": true}', flush=True)
    serve({"run": lambda iters, warmup: {"samples": timed(step, iters, warmup)}})
    client.close()
    tracing.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # the child's side
    args = p.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    log_dir = Path(tempfile.mkdtemp(prefix="grpc-ps-tracing-"))
    blocker = log_dir / "no-otel" / "opentelemetry"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('opentelemetry is not installed here')\n")
    server, url, spans = collector()
    load_before = os.getloadavg()
    children: list[Child] = []
    workers: dict[str, Child] = {}
    pids: dict[str, list[int]] = {}
    try:
        for name, extra in CONFIGS.items():
            env = {k: v for k, v in child_env(1).items() if not k.startswith("OTEL_") and k != "PS_OTEL_ENDPOINT"}
            if "_block" in extra:
                env["PYTHONPATH"] = os.pathsep.join([str(blocker.parent), env["PYTHONPATH"]])
            elif extra:
                env |= extra | {"PS_OTEL_ENDPOINT": url}
            logs = log_dir / f"config{len(workers)}"
            logs.mkdir()
            shards, servers = start_shards(args.shards, 1, env, logs)
            children += shards
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", ",".join(servers)]
            workers[name] = w = Child("worker", argv, env, logs)
            pids[name] = [c.proc.pid for c in (*shards, w)]
            children.append(w)
            w.wait_for(r'"ready"', 300)
        rates: dict[str, list[float]] = {n: [] for n in CONFIGS}
        cpu: dict[str, list[float]] = {n: [] for n in CONFIGS}
        for _ in range(args.rounds):
            for name, w in workers.items():
                before = sum(cpu_seconds(pid) for pid in pids[name])
                w.send("run", iters=args.steps, warmup=args.warmup)
                samples = w.recv(600, "run")["samples"]
                used = sum(cpu_seconds(pid) for pid in pids[name]) - before
                rates[name].append(1.0 / statistics.median(samples))
                cpu[name].append(1000 * used / (args.steps + args.warmup))
    finally:
        stop_all(children)
        server.stop(None)
    load_after = os.getloadavg()
    base = rates["off"]
    print(f"{args.shards} shards x 1 worker, sync, MLP 9,610 parameters, {args.rounds} rounds of {args.steps} steps")
    print(f"{'configuration':36} {'steps/s':>9} {'vs off':>7}  per-round     CPU ms/step (worker + shards)")
    for name, r in rates.items():
        ratios = [a / b for a, b in zip(r, base, strict=True)]
        med = statistics.median(r)
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        ms = statistics.median(cpu[name])
        print(f"{name:36} {med:9.1f} {med / statistics.median(base):7.3f}  {spread:12}  {ms:.2f}")
    print(f"spans received by the collector: {spans[0]}")
    print(f"load average before {load_before[0]:.2f} (5 min {load_before[1]:.2f}), after {load_after[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
