"""``bench/profile_summary.py``: a py-spy profile's busy samples by category, waiting ones left out.

Synthetic collapsed stacks (``py-spy record --native -f raw``: frames joined by ``;``, then the count).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import profile_summary  # noqa: E402

THREAD = "0x7f01 (libc.so.6);thread_run (libpython3.11.so.1.0);Thread.run (threading.py:982)"
SERVE = "DataPlane._serve (ps_server/dataplane/connections.py:220)"
HANDLE = "CallMetrics.handle (ps_server/service/call_metrics.py:150)"


def test_waits_are_left_out_and_a_wrapper_is_charged_for_what_it_runs(tmp_path: Path) -> None:
    stacks = {
        # a data connection's thread waiting for the worker's next call: not busy
        f"{THREAD};{SERVE};recv_exact (ps_common/dataconn.py:161);sock_recv (socketmodule.c:3520);recv (libc.so.6)": 50,
        # a listener waiting for a connection, a thread on a lock: not busy
        f"{THREAD};DataPlane._accept (ps_server/dataplane/connections.py:199);accept4 (libc.so.6)": 40,
        f"{THREAD};Parking.expire (ps_server/dataplane/parked.py:138);PyThread_acquire_lock_timed (libpython.so)": 30,
        # the optimizer step inside the call metrics' wrapper: the step's
        f"{THREAD};{SERVE};{HANDLE};SyncPolicy._close_round (ps_server/policy/sync.py:90);"
        "ParameterStore._apply (ps_server/shard/store.py:179);SGD.step (torch/optim/sgd.py:80)": 7,
        # the wrapper's own work: the metrics'
        f"{THREAD};{SERVE};{HANDLE};observe (prometheus_client/metrics.py:600)": 2,
        # the check of a partition, below the request's read
        f"{THREAD};{SERVE};{HANDLE};Intake.add (ps_server/core/partitions.py:170);"
        "check_finite (ps_common/codec.py:50);THPVariable_dot (libtorch_python.so)": 1,
    }
    path = tmp_path / "shard0.txt"
    path.write_text("".join(f"{stack} {n}\n" for stack, n in stacks.items()))
    total, busy, per = profile_summary.summarize(str(path))
    assert (total, busy) == (130, 10)
    assert per == {
        "optimizer step (torch.optim, its finiteness proof)": 7,
        "shard: call metrics (prometheus-client)": 2,
        "check_finite of received gradients (dot product; exact check if not finite)": 1,
    }
