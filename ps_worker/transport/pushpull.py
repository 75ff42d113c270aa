"""A PushPull in progress: a training step's push and pull, one call per shard, overlapping backward.

:class:`PendingPushPull` is made by :meth:`ps_worker.client.PSClient.begin_push_pull`. Gradients
arrive one parameter at a time (autograd hooks); each message of a started stream goes out as soon as
its partitions are ready. It stamps, recovers and accounts through the session
(:class:`~ps_worker.session.Session`), never through the client's own state.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import overload

import grpc
import torch

from ps_common import frames, tracing
from ps_common.channels import is_loopback
from ps_common.codec import torch_dtype
from ps_worker.transport.calls import Pushed, ShardCalls, is_stale
from ps_worker.transport.encoding import Stamp, WireCodec
from ps_worker.transport.frame_sender import SendOrder, keep_in_order
from ps_worker.transport.link import Answer, Link, choose_link
from ps_worker.transport.request_frames import frames_of

log = logging.getLogger(__name__)


class PendingPushPull:
    """A :meth:`~ps_worker.client.PSClient.push_pull` in progress; made by
    :meth:`~ps_worker.client.PSClient.begin_push_pull`. Each shard's call goes on the link
    :func:`~ps_worker.transport.link.choose_link` picks (:mod:`ps_worker.transport.link`).

    Thread-safe: :meth:`ready` may be called from autograd hooks while gRPC threads send.

    Args:
        path: the client's data calls. out: where the weights land (see ``push_pull``).
        stream: begin each shard's call now, during backward (False: all in :meth:`finish`).
        hyperparameters: per parameter group, the step's values (an lr scheduler's), sent in
            every attempt's header; None: the last push's (none before the first).
        skip: AMP found inf: the shard skips the step.
        samples: diloco: the samples the pushed outer gradient stands for (``PushHeader.sample_count``;
            None: not counted, the field unset).
        codec: the client's codec restricted to some parameters (``WireCodec(keys=...)``: a diloco
            round of one fragment; those go and come, on gRPC only); None: the client's.
    """

    def __init__(
        self,
        path: ShardCalls,
        out: Mapping[str, torch.Tensor],
        stream: bool,
        hyperparameters: Sequence[Mapping[str, float]] | None = None,
        skip: bool = False,
        samples: int | None = None,
        codec: WireCodec | None = None,
    ) -> None:
        self.codec = codec = codec or path.require_codec()
        self.path = path
        self.session = path.session
        self.transport = t = path.transport
        self.out_tensors = out
        self.hyperparameters = path.hyperparameters(hyperparameters)
        self.skip = skip
        self.samples = samples
        self.flats, self.device_out = path.staging.pull_targets(codec.plan, out, codec.keys)
        self._lock = threading.Lock()
        self.cond = threading.Condition()
        self._grads: dict[str, torch.Tensor] = {}
        self._ready: set[str] = set()
        self._outs: list[dict[int, frames.OutPartition]] = [{} for _ in range(t.num_shards)]
        self.groups = codec.request_groups  # fixed by the plan, wire dtype and top-k ratio
        # sync: the round this step's gradient is for, fixed now: every shard and every retry gets
        # the same stamp (a recovery that moves a shard's round drops the push there instead)
        self.round = self.session.push_round()
        self.sent = [0] * t.num_shards
        self._begun: dict[int, Link] = {}
        """Shards whose call began during backward (a push of one message waits for finish())."""
        self.order: SendOrder | None = None  # finish(): the frames' order across shards
        self.span = tracing.start("push_pull", rank=self.session.rank, clock=self.round, shards=t.num_shards)
        """This push's span (tracing on), from here to the end of :meth:`finish` or :meth:`cancel`."""
        if stream:
            self._begun = {k: choose_link(self, k) for k in range(t.num_shards) if not self.once(k)}
            self.order = self._send_order(self._begun, begun=True)
            with tracing.current(self.span, end=False):  # the calls begun now carry its traceparent
                for link in self._begun.values():
                    link.begin()

    # -------------------------------------------------------------- what goes on the wire
    def once(self, k: int) -> bool:
        """Shard ``k`` takes this push in one message (PushPullOnce)."""
        return len(self.groups[k]) == 1 and self.codec.single_response[k]

    def stamp(self, k: int) -> Stamp:
        """What every attempt to shard ``k`` carries besides the gradients."""
        stamp = self.session.stamp(k, self.round, self.hyperparameters, self.skip)
        if self.span is not None:  # a call on a data connection has no metadata: the header carries it
            stamp = dataclasses.replace(stamp, traceparent=tracing.traceparent(self.span))
        return dataclasses.replace(stamp, samples=self.samples) if self.samples is not None else stamp

    def out(self, k: int, i: int) -> frames.OutPartition:
        """Shard ``k``'s partition ``i`` as it goes on the wire, made once (top-k updates its
        error-feedback memory once per step, however often the message is sent). A plain cast is
        made outside the lock, so that the sending threads of several shards cast at once."""
        with self._lock:
            made = self._outs[k].get(i)
            if made is not None or self.codec.compressor is not None:
                return self.out_locked(k, i)
            part = self.codec.owned[k][i]
            grad = self._grads[part.key]
        made = self.codec.to_wire(part, grad, compress=False)
        with self._lock:
            return self._outs[k].setdefault(i, made)

    def out_locked(self, k: int, i: int) -> frames.OutPartition:
        """:meth:`out`, the caller holding the lock."""
        made = self._outs[k].get(i)
        if made is None:
            part = self.codec.owned[k][i]
            made = self._outs[k][i] = self.codec.to_wire(part, self._grads[part.key], compress=True)
        return made

    def group_ready(self, k: int, g: list[int]) -> bool:
        """Every partition of shard ``k``'s message ``g`` has its gradient."""
        owned = self.codec.owned[k]
        return all(owned[i].key in self._ready for i in g)

    def head(self, k: int, data_sequence: int = 0) -> bytes:
        """The header fields of shard ``k``'s first request message (``data_sequence``: the
        partitions go as that frame on the data connection)."""
        return self.codec.push_pull_head(self.stamp(k), data_sequence)

    def messages(self, k: int) -> Iterator[bytes]:
        """Shard ``k``'s request messages, once every gradient is ready (a call made in ``finish()``);
        built as gRPC sends them."""
        work = [[self.out(k, i) for i in g] for g in self.groups[k]]
        return frames_of(work, self.head(k), self.transport.sent, self.sent, k)

    def once_chunks(self, k: int) -> list[bytes | memoryview]:
        """Shard ``k``'s one request message as its buffers (:func:`frames.build_chunks`: the
        partitions' own memory, not joined), counted as sent."""
        (g,) = self.groups[k]
        chunks = frames.build_chunks([self.out(k, i) for i in g], self.head(k))
        n = sum(map(len, chunks))  # bytes and byte views (frames.build_chunks)
        self.sent[k] += n
        if self.transport.metrics is not None:
            self.transport.metrics.sent_bytes.inc(n)
        return chunks

    # -------------------------------------------------------------- the caller's side
    def ready(self, key: str, grad: torch.Tensor) -> None:
        """The gradient of parameter ``key`` is final (any device; copied to host here if needed).
        For a call already begun (during backward), its partitions are cast or top-k selected,
        and the messages or records they complete are built and sent, here in the caller's thread.
        Otherwise they are made as they are sent in ``finish()``: a frame on a data connection
        casts each partition on its sending thread just before it goes out, so the cast of one
        overlaps the sending of the others."""
        flat = grad.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.to("cpu")
        with self._lock:
            self._grads[key] = flat
            self._ready.add(key)
            for k, link in list(self._begun.items()):
                if not link.ready(key):
                    del self._begun[k]  # a broken data connection: the push goes on gRPC in finish()

    def cancel(self) -> None:
        """Abandon this push: cancel the calls begun during backward (a shard applies nothing of
        a cancelled call; a frame begun on a data connection is dropped with the connection, which
        the next push opens again); nothing was accounted and the clock stays."""
        for link in self._begun.values():
            link.cancel()
        self._begun.clear()
        tracing.end(self.span)

    def _send_order(self, links: Mapping[int, Link], begun: bool = False) -> SendOrder | None:
        """The order of this push's frames across shards (:mod:`ps_worker.transport.frame_sender`), when two
        or more of ``links`` (shard -> its link) send a frame on data connections to other hosts:
        their connections then queue little, so that the order holds on the wire. ``begun``: the
        frames begin during backward and take their turns as their gradients are ready."""
        conns = {k: link.frame_connection() for k, link in links.items()}
        # on one machine: nothing to gain
        conns = {k: c for k, c in conns.items() if c is not None and not is_loopback(c.host)}
        if len(conns) < 2:
            return None
        for conn in conns.values():
            keep_in_order(conn)
        return SendOrder(None if begun else {k: len(self.codec.owned[k]) for k in conns})

    def finish(self) -> int:
        """Send what is left (zeros for parameters without a gradient), wait for every shard,
        copy the new weights into ``out``.

        Returns:
            The lowest version among the shards.

        Raises:
            grpc.RpcError: as :meth:`~ps_worker.client.PSClient.push_pull`.
        """
        with tracing.current(self.span):  # ends the span, failed with the step's error if any
            return self._finish()

    def _finish(self) -> int:
        t, s = self.transport, self.session
        for spec in self.codec.plan.specs:
            if spec.key not in self._grads and (self.codec.keys is None or spec.key in self.codec.keys):
                self.ready(spec.key, torch.zeros(math.prod(spec.shape), dtype=torch_dtype(spec.dtype)))
        # made as the frames are sent, kept as sent (a PushLost meanwhile or later pushes it again)
        push = Pushed(_LastPush(self), self.round, self.hyperparameters, self.skip, samples=self.samples)
        if not self._begun and self.order is None:
            self.order = self._send_order({k: choose_link(self, k) for k in range(t.num_shards) if not self.once(k)})
        begun = list(self._begun.values())
        for link in begun:  # every frame is built: the streams may end
            link.end()

        def one(k: int) -> Answer:
            link = self._begun.pop(k, None)
            if link is not None:
                try:
                    return link.attempt()
                except grpc.RpcError:
                    # a call begun during backward failed: the whole push again, with the same
                    # stamp (a shard that accepted it answers as for a duplicate), recovering
                    pass
            return s.with_recovery(
                k, lambda: choose_link(self, k).attempt(), f"PushPull {t.servers[k]}", repush=False, round=self.round
            )

        try:
            results = self.path.send(push, one, lambda r: r[0], "push_pull_duration")
        except grpc.RpcError as exc:
            if not is_stale(exc):
                raise
            log.info("rank %d: push refused as too stale (%s); pulling", s.rank, exc.details())
            return self.path.pull(self.out_tensors)
        finally:
            for link in begun:
                link.end()
        s.pushed_bytes += sum(r[2] for r in results)
        s.pulled_bytes += sum(r[3] for r in results)
        return self.path.finish_pull([r[1] for r in results], self.device_out, self.flats)


class _LastPush(Sequence[list[frames.OutPartition]]):
    """Per shard, a push's partitions as they go on the wire, each made on first use (the same
    objects the push sends: :meth:`PendingPushPull.out`)."""

    def __init__(self, pending: PendingPushPull) -> None:
        self.pending = pending

    def __len__(self) -> int:
        return self.pending.transport.num_shards

    @overload
    def __getitem__(self, k: int) -> list[frames.OutPartition]: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[list[frames.OutPartition]]: ...
    def __getitem__(self, k: int | slice) -> list[frames.OutPartition] | Sequence[list[frames.OutPartition]]:
        if isinstance(k, slice):
            return [self[j] for j in range(len(self))[k]]
        owned = self.pending.codec.owned[k]
        return [self.pending.out(k, i) for i in range(len(owned))]
