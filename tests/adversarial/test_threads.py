"""Long-lived streams (Health/Watch, reflection, Admin/WatchStatus) must not take the
threads that training needs, whoever opens them and however many.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_proto.v1 import ps_pb2, ps_pb2_grpc
from ps_worker import DistributedOptimizer, PSClient

TOKEN = "worker-secret"
ADMIN_TOKEN = "admin-secret"
ADMIN = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
STREAM_TIMEOUT = 60.0
"""Every stream's deadline: far beyond the test, so that only the test's cancel ends one."""
RPC_TIMEOUT = 10.0
WINDOW = 1.0
"""Seconds of one measurement window."""
ROUNDS = 10
"""Measurement windows; the twin that carries the streams alternates."""


class Streams:
    """Long-lived streams opened on ``channels`` (round robin), each read by a thread of its own
    until it ends; :meth:`cancel` ends them all."""

    def __init__(self, channels: list[grpc.Channel]) -> None:
        self.channels = channels
        self.calls: list[Any] = []
        self.first = threading.Semaphore(0)
        self.opened = 0
        self.errors: list[grpc.RpcError] = []
        self._readers: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _read(self, call: Any) -> None:
        seen = False
        try:
            for _ in call:
                if not seen:
                    seen = True
                    with self._lock:
                        self.opened += 1
                    self.first.release()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                with self._lock:
                    self.errors.append(exc)
                self.first.release()  # a refusal ends the wait for this stream too

    def open(self, kind: str) -> None:
        channel = self.channels[len(self.calls) % len(self.channels)]
        if kind == "health":  # unauthenticated, as a k8s probe or an attacker would
            call = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=STREAM_TIMEOUT
            )
        else:  # `ps-admin top`
            call = ps_pb2_grpc.AdminStub(channel).WatchStatus(
                ps_pb2.WatchStatusRequest(interval_seconds=1.0), timeout=STREAM_TIMEOUT, metadata=ADMIN
            )
        self.calls.append(call)
        reader = threading.Thread(target=self._read, args=(call,), daemon=True)
        reader.start()
        self._readers.append(reader)

    def wait_answered(self, timeout: float) -> int:
        """Wait until every stream has its first message or its refusal (at most ``timeout`` s);
        return how many are open."""
        deadline = time.monotonic() + timeout
        for _ in self.calls:
            if not self.first.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break
        return self.opened

    def cancel(self, timeout: float = 10.0) -> None:
        for call in self.calls:
            call.cancel()
        deadline = time.monotonic() + timeout
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        assert not any(r.is_alive() for r in self._readers), "a stream's reader did not end after cancel"


def channels(address: str, n: int) -> list[grpc.Channel]:
    # distinct options make distinct connections, as distinct clients would have
    return [grpc.insecure_channel(address, options=[("grpc.primary_user_agent", f"c{i}")]) for i in range(n)]


class Trainer:
    """Rank 0 training a small model in a thread, recording when each step ends."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.ends: list[float] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timed-trainer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
            with PSClient([self.address], rank=0, num_workers=1, timeout=10, retry_deadline=5, token=TOKEN) as client:
                client.init(model, {"name": "sgd", "lr": 0.01}, init_timeout=20)
                opt = DistributedOptimizer(model, client)
                x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
                while not self._stop.is_set() and len(self.ends) < 1_000_000:
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                    self.ends.append(time.perf_counter())
        except BaseException as exc:  # re-raised by stop()
            self.error = exc

    def stop(self, timeout: float = 20.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the trainer did not stop within {timeout} s"
        if self.error is not None:
            raise self.error

    def steps(self) -> tuple[int, float]:
        """(steps so far, now)."""
        return len(self.ends), time.perf_counter()

    @staticmethod
    def rate(before: tuple[int, float], after: tuple[int, float]) -> float:
        """Steps per second between two :meth:`steps`."""
        return (after[0] - before[0]) / (after[1] - before[1])


def streams_closed(shard: Any) -> bool:
    """True once no long-lived stream holds a slot (always, on a shard without stream limits)."""
    limits = getattr(getattr(shard, "streams", None), "limits", {})
    return all(limit.open == 0 for limit in limits.values())


def test_open_watch_streams_leave_training_its_threads(start_cluster, wait_until) -> None:
    """64 open streams (48 unauthenticated Health/Watch, 16 Admin/WatchStatus) on a token-protected
    shard: training keeps >= 90 % of its unloaded step rate.

    Two twin shards, each trained by its own trainer, at the same time: in each window one of them
    carries the 64 streams, and the roles alternate window by window. A window's ratio is the loaded
    trainer's step rate over its unloaded twin's in that same window, so the load of other processes
    on a shared machine (which changes within seconds and slows any window several times) slows
    both sides alike; the median of the ratios must be >= 0.9. Each trainer's own median step rates
    with and without the streams are reported too. Both shards live in this process, so the streams'
    CPU cost (a few % of a core for 64) is borne by both sides: this measures what the streams do to
    the shard's threads, the subject of the test."""
    twins = [start_cluster(1, num_workers=1, token=TOKEN, admin_token=ADMIN_TOKEN)[0] for _ in range(2)]
    trainers = [Trainer(shard.address) for shard in twins]
    ratios: list[float] = []
    rates: list[list[tuple[float, bool]]] = [[], []]  # per trainer: (steps/s, loaded)
    open_counts: list[int] = []
    errors: list[grpc.RpcError] = []
    try:
        for t in trainers:
            wait_until(lambda t=t: len(t.ends) >= 50 or t.error, 30, "the trainers' first 50 steps")
            assert t.error is None, t.error
        for round_ in range(ROUNDS):
            loaded = round_ % 2
            chans = channels(twins[loaded].address, 8)
            streams = Streams(chans)
            try:
                for kind in ["health"] * 48 + ["watch"] * 16:
                    streams.open(kind)
                open_counts.append(streams.wait_answered(timeout=5.0))
                before = [t.steps() for t in trainers]
                time.sleep(WINDOW)  # a measurement window, not a synchronization
                after = [t.steps() for t in trainers]
                errors.extend(streams.errors)
            finally:
                streams.cancel()
                for ch in chans:
                    ch.close()
            window = [Trainer.rate(b, a) for b, a in zip(before, after, strict=True)]
            for k in (0, 1):
                rates[k].append((window[k], k == loaded))
            ratios.append(window[loaded] / window[1 - loaded] if window[1 - loaded] else 0.0)
            wait_until(lambda shard=twins[loaded]: streams_closed(shard), 10, "the cancelled streams' handlers to end")
    finally:
        for t in trainers:
            t.stop()
    ratio = statistics.median(ratios)
    own = [(statistics.median(r for r, on in rs if not on), statistics.median(r for r, on in rs if on)) for rs in rates]
    print(
        f"\nloaded/unloaded twin per window {[round(r, 2) for r in ratios]}, median {ratio:.2f}; "
        + "; ".join(
            f"trainer {k}: median {off:.0f} steps/s unloaded, {on:.0f} with 64 open streams ({on / off:.2f})"
            for k, (off, on) in enumerate(own)
        )
    )
    assert ratio >= 0.9, f"training under 64 open streams ran at {ratio:.0%} of its unloaded twin's step rate"
    assert open_counts == [64] * ROUNDS, f"streams open per round: {open_counts}; errors: {errors[:3]}"
    assert not errors


@pytest.fixture
def secured_shard(start_cluster):
    (shard,) = start_cluster(1, num_workers=1, token=TOKEN, admin_token=ADMIN_TOKEN)
    return shard


def test_stream_limits_refuse_extras_at_once_and_keep_the_data_plane(secured_shard, wait_until) -> None:
    """At their limits (16 WatchStatus, 64 public) one more stream of either group is refused at once
    with RESOURCE_EXHAUSTED naming its flag; a closed stream frees its slot; meanwhile Join, GetStatus
    and Health/Check are answered, and a refused token never takes a slot."""
    shard = secured_shard
    chans = channels(shard.address, 8)
    streams = Streams(chans)
    try:
        for kind in ["watch"] * 16 + ["health"] * 64:
            streams.open(kind)
        assert streams.wait_answered(timeout=15.0) == 80, streams.errors[:3]
        assert shard.streams.limits["watch"].open == 16 and shard.streams.limits["public"].open == 64
        channel = chans[0]
        admin = ps_pb2_grpc.AdminStub(channel)
        for call, flag in (
            (
                admin.WatchStatus(ps_pb2.WatchStatusRequest(), timeout=RPC_TIMEOUT, metadata=ADMIN),
                "--max-watch-streams",
            ),
            (
                health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT),
                "--max-public-streams",
            ),
        ):
            with pytest.raises(grpc.RpcError) as err:
                next(call)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert flag in err.value.details() and "close one or raise the limit" in err.value.details()
            assert ("ps-reason", "TOO_MANY_STREAMS") in tuple(err.value.trailing_metadata())
        for method in ("ps.v1.Admin/WatchStatus", "grpc.health.v1.Health/Watch"):  # counted by code
            labels = {"method": method, "code": "RESOURCE_EXHAUSTED"}
            assert shard.metrics.registry.get_sample_value("ps_rpc_duration_seconds_count", labels) == 1
        # a wrong token is UNAUTHENTICATED, not a stream
        with pytest.raises(grpc.RpcError) as err:
            next(admin.WatchStatus(ps_pb2.WatchStatusRequest(), timeout=RPC_TIMEOUT))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # the data plane, Admin's unary calls and health checks are answered meanwhile
        join = ps_pb2_grpc.ParameterServiceStub(channel).Join(
            ps_pb2.JoinRequest(rank=0, num_workers=1, incarnation=1),
            timeout=RPC_TIMEOUT,
            metadata=(("authorization", f"Bearer {TOKEN}"),),
        )
        assert join.num_shards == 1
        assert admin.GetStatus(ps_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT, metadata=ADMIN).status.num_shards == 1
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        # a watcher still sees a change of status (a k8s-style probe)
        shard.health.set("ps.v1.Admin", health_pb2.HealthCheckResponse.NOT_SERVING)
        streams.calls[16].cancel()  # frees a public slot
        wait_until(lambda: shard.streams.limits["public"].open == 63, 10, "the cancelled watcher's slot")
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="ps.v1.Admin"), timeout=RPC_TIMEOUT
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        shard.health.set("ps.v1.Admin", health_pb2.HealthCheckResponse.SERVING)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        streams.calls[0].cancel()  # frees a watch slot once its handler is done
        wait_until(lambda: shard.streams.limits["watch"].open == 15, 10, "the cancelled WatchStatus's slot")
        again = admin.WatchStatus(ps_pb2.WatchStatusRequest(), timeout=RPC_TIMEOUT, metadata=ADMIN)
        assert next(again).status.num_shards == 1
        again.cancel()
    finally:
        streams.cancel()
        for ch in chans:
            ch.close()
    wait_until(
        lambda: shard.streams.limits["watch"].open == 0 and shard.streams.limits["public"].open == 0,
        10,
        "every slot back after cancel",
    )


def _watch_handlers() -> int:
    """Threads of this process now running an Admin/WatchStatus handler."""
    count = 0
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name == "WatchStatus" and frame.f_globals.get("__name__") == "ps_server.service.admin":
                count += 1
                break
            frame = frame.f_back
    return count


def test_a_closed_watch_ends_its_handler_at_once_whatever_its_interval(secured_shard, wait_until) -> None:
    """A WatchStatus stream asking for one status an hour (`ps-admin top --interval 3600`) and then
    closed ends its handler, and so gives back its thread and its --max-watch-streams slot, within
    seconds, not after its interval."""
    shard = secured_shard
    with grpc.insecure_channel(shard.address) as channel:
        call = ps_pb2_grpc.AdminStub(channel).WatchStatus(
            ps_pb2.WatchStatusRequest(interval_seconds=3600), timeout=STREAM_TIMEOUT, metadata=ADMIN
        )
        assert next(call).status.num_shards == 1
        wait_until(lambda: _watch_handlers() == 1, 5, "the handler to wait for its next interval")
        call.cancel()
        wait_until(lambda: _watch_handlers() == 0, 5, "the closed hourly watch's handler to end")
        wait_until(lambda: shard.streams.limits["watch"].open == 0, 5, "the closed hourly watch's slot")
