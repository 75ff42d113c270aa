"""The acceptance series of the lost-rounds scenarios, run by hand (not collected by pytest):
each scenario N times, printing how many runs passed and how long each took.

    python -m tests.chaos.series --runs 10 [--scenarios kill,kill-pause] [--transports tcp,grpc]
        [--durable off,on]

``kill``: shard 1 ``kill -9``ed a few rounds after a periodic checkpoint and restarted; the run must
end bitwise on an uninterrupted run's parameters (one reference run per transport). ``kill-pause``:
the same while rank 1 is paused past its lease, evicted and resumed; both ranks must end on one
model. Every run is bounded (tests/e2e/test_lost_rounds.py's deadlines); a failure prints its reason
and the series goes on. The last results are in docs/faults.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from tests.e2e.test_lost_rounds import LEASE, run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10, help="runs per scenario (1..100)")
    p.add_argument("--scenarios", default="kill,kill-pause")
    p.add_argument("--transports", default="tcp,grpc")
    p.add_argument("--durable", default="off,on", help="without and/or with --durable-acks")
    args = p.parse_args(argv)
    if not 1 <= args.runs <= 100:
        p.error("--runs must be 1..100")
    root = Path(tempfile.mkdtemp(prefix="ps-series-"))
    print(f"load average at start: {os.getloadavg()[0]:.1f}; work in {root}", flush=True)
    failed = 0
    for transport in args.transports.split(","):
        reference = {d["params_sha256"] for d in run(root / f"reference-{transport}", "none", transport)}
        for scenario in args.scenarios.split(","):
            for durable in args.durable.split(","):
                passed, walls = 0, []
                for i in range(args.runs):
                    start = time.monotonic()
                    try:
                        tmp = root / f"{scenario}-{transport}-{durable}-{i}"
                        lease = LEASE if scenario == "kill-pause" else 4 * LEASE
                        shas = {d["params_sha256"] for d in run(tmp, scenario, transport, lease, durable == "on")}
                        ok = len(shas) == 1 and (scenario != "kill" or shas == reference)
                        why = "" if ok else f"params {shas} (reference {reference})"
                    except AssertionError as exc:
                        ok, why = False, str(exc).splitlines()[0]
                    walls.append(time.monotonic() - start)
                    passed += ok
                    if not ok:
                        print(f"  {scenario} {transport} durable={durable} run {i}: FAILED: {why}", flush=True)
                failed += args.runs - passed
                print(
                    f"{scenario:10s} {transport:4s} durable={durable:3s}: {passed}/{args.runs} passed, "
                    f"{min(walls):.0f}-{max(walls):.0f} s per run, load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
