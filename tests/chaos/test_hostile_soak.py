"""A sync job of 2 shards x 2 workers trained under 64 hostile clients that hold the worker token:
waiting calls (unreachable versions, hour-long deadlines, header-only streams), table bombs,
parked data-connection frames, forged membership records and unauthorized resizes.

The job runs twice as real processes (``ps-server``, ``ps-worker digits``): once undisturbed, once
under attack. It must end on the same bits (``params_sha256`` of both ranks), every shard must
answer Health within :data:`HEALTH_BOUND` seconds throughout, and every shard's resident memory must
stay under :data:`RSS_BOUND_BYTES`. Bounded: the attackers stop when the job ends or after
:data:`ATTACK_SECONDS`, whichever comes first; every call they hold is cancelled by them.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from tests.chaos.harness import free_port
from tests.helpers import hostile
from tests.helpers.processes import wait_for_listening

TOKEN = "soak-worker-token"
ADMIN_TOKEN = "soak-admin-token"
CLIENTS = 64
"""Hostile clients, each a thread with a connection of its own."""
STEPS = 250
"""Steps per rank of the job."""
SLOW_MS = 80.0
"""Rank 0 sleeps this long before each push (the job's pace; it changes no bit of the result)."""
ATTACK_SECONDS = 120.0
"""The attackers stop by then even if the job has not finished."""
JOB_SECONDS = 240.0
"""A worker that has not finished by then fails the test."""
HEALTH_BOUND = 1.0
"""Seconds within which every Health check must be answered."""
RSS_BOUND_BYTES = 768 * 2**20
"""Resident memory a shard may reach under attack. Here a shard of this job holds 330-340 MiB
(torch imported, a small model), attacked or not; what the bounds let an attacker take on top is
small for this model (parked frames: ``--max-parked-bytes``, two frames of the shard's partitions
per rank; a table bomb is refused before it allocates), so twice that is a generous ceiling that an
unbounded allocation (one 65,536-wide adam row used to take ~1 GiB) breaks."""

ATTACKS = {
    "waiting_pull": hostile.waiting_pull,
    "waiting_pull_rows": hostile.waiting_pull_rows,
    "waiting_init_tables": hostile.waiting_init_tables,
    "header_only_push_pull": hostile.header_only_push_pull,
    "table_bomb": hostile.table_bomb,
    "parked_frame": hostile.parked_frame,
    "record_from_earlier_job": hostile.forged_record(ADMIN_TOKEN, "an-earlier-job"),
    "record_with_guessed_key": hostile.forged_record("guessed-admin-token", "an-earlier-job"),
    "unauthorized_resize": hostile.unauthorized_resize,
}


RELAYED = {"record_from_earlier_job", "record_with_guessed_key"}
"""Attacks whose Heartbeat may be answered OK: what counts is that their records are not followed."""


def admin_status(address: str) -> ps_pb2.ShardStatus:
    with grpc.insecure_channel(address) as channel:
        stub = ps_pb2_grpc.AdminStub(channel)
        metadata = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
        return stub.GetStatus(ps_pb2.GetStatusRequest(), timeout=10.0, metadata=metadata).status


@dataclass
class Job:
    shards: list[subprocess.Popen[str]]
    addresses: list[str]
    data_ports: list[int]
    workers: list[subprocess.Popen[str]] = field(default_factory=list)

    def stop(self) -> None:
        for proc in [*self.workers, *self.shards]:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def start_job(tmp: Path, slow_ms: float) -> Job:
    env = {**os.environ, "PS_TOKEN": TOKEN, "PS_ADMIN_TOKEN": ADMIN_TOKEN}
    shards, data_ports = [], []
    for k in range(2):
        data_port = free_port()
        log = open(tmp / f"shard-{k}.err", "w")  # noqa: SIM115 (closed with the process's end)
        proc = subprocess.Popen(
            [sys.executable, "-m", "ps_server.cli", "--shard-index", str(k), "--num-shards", "2", "--num-workers", "2"]
            + ["--mode", "sync", "--port", "0", "--data-port", str(data_port), "--metrics-port", "-1"],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
        shards.append(proc)
        data_ports.append(data_port)
    job = Job(shards, [], data_ports)
    try:
        job.addresses = [wait_for_listening(proc) for proc in shards]
        for r in range(2):
            out = open(tmp / f"worker-{r}.out", "w")  # noqa: SIM115
            err = open(tmp / f"worker-{r}.err", "w")  # noqa: SIM115
            argv = [sys.executable, "-m", "ps_worker.workloads.cli", "digits", "--servers", ",".join(job.addresses)]
            argv += ["--rank", str(r), "--num-workers", "2", "--steps", str(STEPS), "--seed", "0", "--json"]
            argv += ["--no-progress", "--timeout", "30", "--slow-rank", "0", "--slow-ms", str(slow_ms)]
            job.workers.append(subprocess.Popen(argv, stdout=out, stderr=err, text=True, env=env))
    except BaseException:
        job.stop()
        raise
    return job


def finish(job: Job, tmp: Path) -> list[str]:
    """Wait for both workers; returns each rank's params_sha256."""
    deadline = time.monotonic() + JOB_SECONDS
    for r, proc in enumerate(job.workers):
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker {r} did not finish within {JOB_SECONDS:.0f} s; see {tmp}")
        assert code == 0, f"worker {r} exited {code}: {(tmp / f'worker-{r}.err').read_text()[-3000:]}"
    hashes = []
    for r in range(2):
        last = (tmp / f"worker-{r}.out").read_text().strip().splitlines()[-1]
        hashes.append(json.loads(last)["params_sha256"])
    return hashes


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


HEALTH_PROBE = r"""
import json, sys, threading, time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
stubs = [health_pb2_grpc.HealthStub(grpc.insecure_channel(a)) for a in sys.argv[2:]]
slowest, failures, checks, stop = [0.0] * len(stubs), [], 0, threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
ends = time.monotonic() + float(sys.argv[1])
while not stop.wait(0.25) and time.monotonic() < ends:
    for k, stub in enumerate(stubs):
        began = time.monotonic()
        try:
            answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5.0)
            if answer.status != health_pb2.HealthCheckResponse.SERVING:
                failures.append(f"shard {k}: {answer.status}")
        except grpc.RpcError as exc:
            failures.append(f"shard {k}: {exc.code().name}")
        slowest[k] = max(slowest[k], time.monotonic() - began)
        checks += 1
print(json.dumps({"slowest": slowest, "failures": failures[:20], "checks": checks}), flush=True)
"""
"""Health/Check of every shard every 0.25 s, each with a 5 s deadline (a slow answer is measured, not
cut), from a process of its own: the attackers' threads in the test process do not delay it. It
prints its findings when its stdin closes (or after ``argv[1]`` seconds)."""


class Watch:
    """The Health probe (:data:`HEALTH_PROBE`) and each shard's resident memory, until closed."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.slowest = [0.0] * len(job.addresses)
        self.failures: list[str] = []
        self.checks = 0
        self.peak_rss = [0] * len(job.shards)
        self.stop = threading.Event()
        self.probe = subprocess.Popen(
            [sys.executable, "-c", HEALTH_PROBE, str(JOB_SECONDS), *job.addresses],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.25):
            for k, proc in enumerate(self.job.shards):
                if proc.poll() is None:
                    self.peak_rss[k] = max(self.peak_rss[k], rss_bytes(proc.pid))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        try:
            out, _ = self.probe.communicate("", timeout=30)
        except subprocess.TimeoutExpired:
            self.probe.kill()
            self.probe.wait(timeout=10)
            self.failures.append("the Health probe did not report within 30 s")
            return
        found = json.loads(out.strip().splitlines()[-1])
        self.slowest, self.failures, self.checks = found["slowest"], found["failures"], found["checks"]


class Attackers:
    """``CLIENTS`` threads, each with its own connection, each running attacks chosen by its own
    seeded generator until stopped or :data:`ATTACK_SECONDS` passed."""

    def __init__(self, job: Job, seed: int) -> None:
        self.targets = [hostile.Target(a, p, TOKEN) for a, p in zip(job.addresses, job.data_ports, strict=True)]
        self.stop = threading.Event()
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(seed + i, i), daemon=True) for i in range(CLIENTS)]
        for thread in self.threads:
            thread.start()

    def _run(self, seed: int, i: int) -> None:
        rng = random.Random(seed)
        target = self.targets[i % len(self.targets)]
        channel = grpc.insecure_channel(target.address, options=[("grpc.primary_user_agent", f"hostile-{i}")])
        names = sorted(ATTACKS)
        ends = time.monotonic() + ATTACK_SECONDS
        try:
            while not self.stop.is_set() and time.monotonic() < ends:
                name = names[rng.randrange(len(names))]
                try:
                    outcome = ATTACKS[name](channel, target, rng, rng.uniform(0.2, 2.0), self.stop)
                except Exception as exc:  # an attacker's own bug must be seen, not hidden
                    with self._lock:
                        self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                    return
                with self._lock:
                    self.outcomes[(name, outcome)] += 1
        finally:
            channel.close()

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)
        assert not any(t.is_alive() for t in self.threads), "an attacker did not stop within 30 s"


@pytest.mark.slow
def test_a_sync_job_under_64_hostile_clients_ends_on_the_same_bits(tmp_path: Path) -> None:
    seed = int(os.environ.get("PS_SOAK_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"hostile soak: seed {seed}")

    quiet = tmp_path / "quiet"
    quiet.mkdir()
    job = start_job(quiet, SLOW_MS / 8)
    try:
        expected = finish(job, quiet)
    finally:
        job.stop()
    assert expected[0] == expected[1], f"the undisturbed ranks disagree: {expected}"

    attacked = tmp_path / "attacked"
    attacked.mkdir()
    job = start_job(attacked, SLOW_MS)
    watch = Watch(job)
    attackers = Attackers(job, seed)
    try:
        hashes = finish(job, attacked)
        statuses = [admin_status(a) for a in job.addresses]
    finally:
        attackers.close()
        watch.close()
        job.stop()

    report = "\n".join(f"  {n:<24} {o:<28} {c}" for (n, o), c in sorted(attackers.outcomes.items()))
    print(
        f"hostile soak: {sum(attackers.outcomes.values())} attacks\n{report}\n"
        f"  health checks {watch.checks}, slowest per shard {[round(s, 3) for s in watch.slowest]} s\n"
        f"  peak RSS per shard {[r // 2**20 for r in watch.peak_rss]} MiB"
    )
    assert not attackers.errors, attackers.errors[:5]
    assert sum(attackers.outcomes.values()) >= CLIENTS, "the attackers barely ran"
    assert {n for n, _ in attackers.outcomes} == set(ATTACKS), "some attack never ran"
    # a Heartbeat of a rank that is not live under its incarnation is answered (with the rank's state)
    # but relays nothing: its record must not be followed, which the statuses below check
    accepted = {(n, o) for n, o in attackers.outcomes if n not in RELAYED and (o == "OK" or "OK" in o.split("+"))}
    assert not accepted, f"the shards accepted hostile calls: {sorted(accepted)}"
    clusters = {st.membership.cluster_id for st in statuses}
    assert len(clusters) == 1 and "an-earlier-job" not in clusters, clusters
    assert [st.config.num_workers for st in statuses] == [2, 2]
    assert [st.config.learning_rate for st in statuses] == pytest.approx([0.1, 0.1])
    assert hashes == expected, f"the attacked job ended on other bits: {hashes} vs {expected}"
    assert not watch.failures, watch.failures[:5]
    assert watch.checks > 0
    assert max(watch.slowest) < HEALTH_BOUND, f"Health took {max(watch.slowest):.2f} s under attack"
    assert 0 < max(watch.peak_rss) < RSS_BOUND_BYTES, f"a shard reached {max(watch.peak_rss) // 2**20} MiB"
