"""Streamed sync rounds (``--stream-rounds``) over real shards and data connections: each slot's new
values go back while the round's later partitions still arrive, bitwise what the round gives when
answered at its close; a stream that cannot stand for its round is dropped on both sides."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest
import torch

from ps_worker import PSClient
from ps_worker.workloads.train import params_sha256
from tests.conftest import RPC_TIMEOUT
from tests.helpers.ranks import train_ranks
from tests.integration.test_metrics import samples, scrape, value

STEPS = 5
BATCH = 8
PARTITION_BYTES = 4096  # several partitions per shard: rounds stream slot by slot
OPTIMIZERS = {"momentum": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "adam": {"name": "adam", "lr": 0.01}}


def model(batch_norm: bool = True) -> torch.nn.Module:
    """16 -> 128 (-> BatchNorm) -> 64 -> 3: parameters (and buffers: running statistics) in several
    partitions."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 128),
        torch.nn.BatchNorm1d(128) if batch_norm else torch.nn.Identity(),
        torch.nn.Tanh(),
        torch.nn.Linear(128, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 3),
    )


def train(addresses: list[str], data_path: str, optimizer: str, wire_dtype: str | None):
    return train_ranks(
        addresses,
        2,
        model,
        STEPS,
        BATCH,
        OPTIMIZERS[optimizer],
        overlap=True,
        partition_bytes=PARTITION_BYTES,
        wire_dtype=wire_dtype,
        data_path=data_path,
    )


@pytest.mark.parametrize("wire_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_streamed_rounds_are_bitwise_the_rounds_answered_at_their_close(start_cluster, optimizer, wire_dtype) -> None:
    streamed = start_cluster(num_shards=2, num_workers=2, data_port=0, stream_rounds="on")
    got, connected = train(streamed.addresses, "tcp", optimizer, wire_dtype)
    assert connected == [[True, True], [True, True]]
    assert [(s.shard.streamed_rounds, s.shard.unstreamed_rounds) for s in streamed] == [(STEPS, 0)] * 2
    for server in streamed:  # operators see it on /metrics
        found = samples(scrape(server.metrics_url))
        assert value(found, "ps_streamed_rounds_total", outcome="streamed") == STEPS
        assert value(found, "ps_streamed_rounds_total", outcome="put_back") == 0
    auto = start_cluster(num_shards=2, num_workers=2, data_port=0)  # auto: loopback connections do not stream
    unstreamed, connected = train(auto.addresses, "tcp", optimizer, wire_dtype)
    assert connected == [[True, True], [True, True]]
    assert [(s.shard.streamed_rounds, s.shard.unstreamed_rounds) for s in auto] == [(0, 0)] * 2
    grpc_only = start_cluster(num_shards=2, num_workers=2, data_port=0)
    want, _ = train(grpc_only.addresses, "grpc", optimizer, wire_dtype)
    assert [s.shard.streamed_rounds for s in grpc_only] == [0, 0]  # no data connections: nothing streams
    digests = {params_sha256(m) for m in (*got, *unstreamed, *want)}
    assert len(digests) == 1
    buffers = [dict(m.named_buffers()) for m in (got[0], want[0])]
    assert all(torch.equal(buffers[0][k], buffers[1][k]) for k in buffers[0])


def test_a_bad_partition_mid_stream_puts_the_round_back_and_the_waiting_rank_gets_the_rounds_values(
    start_cluster, wait_until
) -> None:
    """Rank 0's push is in; rank 1's partitions step the round's slots one by one (rank 0 receives
    them) until its last partition holds a NaN: rank 1 is refused INVALID_ARGUMENT, every
    stepped slot is put back, rank 0 is told to drop what it received; rank 1 pushes again and both
    get the round's values, bitwise those of a shard that never streamed."""

    def run(stream_rounds: str, bad_first: bool) -> tuple[list[str], int, int]:
        cluster = start_cluster(num_shards=1, num_workers=2, data_port=0, stream_rounds=stream_rounds)
        shard = cluster[0].shard
        clients = [
            PSClient(
                cluster.addresses,
                rank=r,
                num_workers=2,
                incarnation=1,
                timeout=RPC_TIMEOUT,
                partition_bytes=PARTITION_BYTES,
            )
            for r in range(2)
        ]
        models = [model(batch_norm=False), model(batch_norm=False)]
        for c, m in zip(clients, models, strict=True):
            c.init(m, OPTIMIZERS["momentum"])
        g = torch.Generator().manual_seed(3)
        grads = [{k: torch.randn(p.shape, generator=g) for k, p in m.named_parameters()} for m in models]
        errors: list[BaseException] = []

        def rank0() -> None:
            try:
                clients[0].push_pull(grads[0], models[0].state_dict())
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        pusher = threading.Thread(target=rank0)
        pusher.start()
        # rank 0's whole push is on the shard before rank 1's begins
        wait_until(lambda: 0 in shard.rounds.pending or _offered_all(shard, 0), RPC_TIMEOUT, "rank 0's push")
        if bad_first:
            bad = {k: v.clone() for k, v in grads[1].items()}
            last = list(bad)[-1]
            bad[last].view(-1)[-1] = float("nan")
            with pytest.raises(grpc.RpcError) as refused:
                clients[1].push_pull(bad, models[1].state_dict())
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        clients[1].push_pull(grads[1], models[1].state_dict())
        pusher.join(timeout=RPC_TIMEOUT)
        assert not pusher.is_alive() and not errors, errors
        assert shard.version == 1
        if bad_first:  # every slot but the bad one was stepped and sent to rank 0, then put back
            assert shard.stream is not None and shard.stream.undone == len(shard.store.tensors) - 1
            assert value(samples(scrape(cluster[0].metrics_url)), "ps_streamed_rounds_total", outcome="put_back") == 1
        out = [params_sha256(m) for m in models], shard.streamed_rounds, shard.unstreamed_rounds
        for c in clients:
            c.close()
        return out

    got, streamed, unstreamed = run("on", bad_first=True)
    assert (streamed, unstreamed) == (0, 1)
    want, streamed, _ = run("off", bad_first=False)
    assert streamed == 0
    assert got == want and got[0] == got[1]
    again, streamed, unstreamed = run("on", bad_first=False)  # no bad push: the round streams
    assert (streamed, unstreamed) == (1, 0) and again == want


def _offered_all(shard, rank: int) -> bool:
    with shard._cond:
        stream = shard.stream
        return (
            stream is not None
            and all(rank in by_rank for by_rank in stream.grads.values())
            and (len(stream.grads) == stream.num_slots)
        )


def test_frames_sent_in_order_across_shards_give_the_same_rounds(start_cluster, monkeypatch) -> None:
    """Shards on other hosts (here: loopback taken for another host): a push's frames go out slot by
    slot over the shards, on connections that queue little; the rounds are bitwise the same."""
    from ps_worker.transport import frame_sender, pushpull

    orders: list[dict[int, int]] = []
    buffers: list[int] = []

    class Recorded(frame_sender.SendOrder):
        def __init__(self, counts: dict[int, int]) -> None:
            orders.append(dict(counts))
            super().__init__(counts)

    def keep_in_order(conn) -> None:
        frame_sender.keep_in_order(conn)
        buffers.append(conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))

    monkeypatch.setattr(pushpull, "is_loopback", lambda host: False)
    monkeypatch.setattr(pushpull, "SendOrder", Recorded)
    monkeypatch.setattr(pushpull, "keep_in_order", keep_in_order)
    ordered = start_cluster(num_shards=2, num_workers=2, data_port=0, stream_rounds="on")
    got, connected = train_ranks(
        ordered.addresses, 2, model, STEPS, BATCH, OPTIMIZERS["momentum"], partition_bytes=PARTITION_BYTES
    )
    assert connected == [[True, True], [True, True]]
    assert len(orders) == 2 * STEPS and all(o.keys() == {0, 1} and min(o.values()) > 1 for o in orders)
    assert buffers and set(buffers) == {2 * frame_sender.SEND_BUFFER_BYTES}  # Linux doubles SO_SNDBUF
    assert [s.shard.streamed_rounds for s in ordered] == [STEPS, STEPS]
    monkeypatch.undo()
    grpc_only = start_cluster(num_shards=2, num_workers=2, data_port=0)
    want, _ = train_ranks(
        grpc_only.addresses,
        2,
        model,
        STEPS,
        BATCH,
        OPTIMIZERS["momentum"],
        partition_bytes=PARTITION_BYTES,
        data_path="grpc",
    )
    assert len({params_sha256(m) for m in (*got, *want)}) == 1
