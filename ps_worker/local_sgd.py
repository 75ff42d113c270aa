"""The steps of the local-optimizer modes, easgd and diloco (docs/architecture.md#5-consistency).

In both, ``DistributedOptimizer.step()`` steps the script's own torch optimizer on this rank's
copy of the model, and every few steps talks to the shards:

- **easgd** (Zhang, Choromanska, LeCun 2015, Algorithm 1): every tau local steps the rank
  exchanges its parameters with the center (``PSClient.exchange``).
- **diloco** (Douillard et al. 2023, arXiv:2311.08105, Algorithm 1): every H inner steps the rank
  pushes its outer gradient ``delta = theta_global - theta_local`` (the parameters of the last
  outer round minus its own now) as one sync round's gradient; the shards average the ranks'
  deltas (weighted by :meth:`LocalSteps.count_samples` when every rank counts: FedAvg, McMahan et
  al. 2017) and step the outer optimizer (the server-side optimizer) with it; the pull of the
  round's result sets ``theta_local = theta_global``. The inner optimizer keeps its state across
  rounds, as in the paper.
- **Streaming DiLoCo** (``--fragments F``; Douillard et al. 2025, arXiv:2501.18512, Algorithm 1
  without overlap, mixing alpha = 0): every H/F inner steps an outer round carries one fragment,
  ``t mod F`` for round t (:mod:`ps_common.fragments`): its delta goes, its theta_global comes back
  and replaces the local fragment and its anchor; the other fragments keep training. Each fragment
  is thus synchronized every H inner steps, the fragments at offsets of H/F.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ps_common.fragments import fragment_keys, round_fragment
from ps_common.outer_rounds import in_force
from ps_worker.client import PSClient
from ps_worker.transport.encoding import WireCodec
from ps_worker.transport.pushpull import PendingPushPull


class LocalSteps:
    """The local optimizer of one ``DistributedOptimizer`` and its exchanges with the shards.

    Args:
        client: the initialized client.
        params: name -> parameter of the model (the tensors the optimizer steps).
        optimizer: the local (inner) torch optimizer.
        buffers: name -> buffer of the model in the plan (BatchNorm statistics).
        buffer_values: this rank's buffers as the plan carries them (pushed with an outer round).
        pull_targets: where a pull writes (the parameters and the buffers' staging tensors).
        buffers_pulled: called once an outer round pulled rank 0's buffers (loaded before the next forward).

    Attributes:
        steps: local steps taken. in_round: diloco: inner steps since the last outer round.
        anchor: diloco: theta_global, the parameters the last outer round (or Init) left (clones,
            name -> tensor of the parameter's shape and dtype: one more copy of the model); easgd: {}.
        samples: diloco: samples counted since the last outer round (its FedAvg weight); with F > 1
            fragments, ``fragment_samples[p]``: since fragment p's last round.
    """

    def __init__(
        self,
        client: PSClient,
        params: Mapping[str, torch.Tensor],
        optimizer: torch.optim.Optimizer,
        buffers: Mapping[str, torch.Tensor],
        buffer_values: Callable[[], dict[str, torch.Tensor]],
        pull_targets: Callable[[], dict[str, torch.Tensor]],
        buffers_pulled: Callable[[], None],
    ) -> None:
        self.client, self.params, self.optimizer = client, dict(params), optimizer
        self.buffers, self.buffer_values = dict(buffers), buffer_values
        self.pull_targets, self.buffers_pulled = pull_targets, buffers_pulled
        self.steps = self.in_round = self.samples = 0
        self.counting = False
        """count_samples was called: every outer round sends its count, 0 too (FedAvg)."""
        self.fragment_samples: list[int] = []
        self._codecs: dict[tuple[str, int, int], WireCodec] = {}
        """diloco with F > 1: (plan digest, F, fragment) -> the client's codec restricted to the fragment."""
        rounds = client.worker_mode.pushes_in_rounds  # diloco; easgd's exchanges need no copy of theta_global
        self.anchor = {k: p.detach().clone() for k, p in self.params.items()} if rounds else {}
        if rounds:  # rank 0 writes theta_global, not this rank's inner steps, to a shard that restarted empty
            client.path.rewrite_source = self.global_values

    def global_values(self) -> tuple[dict[str, torch.Tensor], int]:
        """diloco: theta_global (:attr:`anchor`) and the version it is of (the outer round this rank
        is in): what rank 0 writes to a shard that restarted with no checkpoint, so that the shard
        goes on with that round (pushed again to it) and no outer round is lost or redone. The
        outer optimizer's state of that shard's partitions starts over (a checkpoint keeps it)."""
        return self.anchor, self.client.version

    def period(self) -> int:
        """tau (easgd) or H (diloco) in force: ``--communication-period`` as the Join told it, or a
        live change (``ps-admin set --communication-period``) once the model holds the version it is
        scheduled at (diloco: the outer round it governs, the same on every rank); the membership
        records the shards relay carry the changes."""
        return self._in_force("communication_period")

    def fragments(self) -> int:
        """F in force (diloco's ``--fragments``, or a live change as :meth:`period` says; 1 in easgd)."""
        settings = self.client.settings
        return self._in_force("fragments") if settings is not None and settings.mode == "diloco" else 1

    def _in_force(self, field: str) -> int:
        """ClusterConfig's ``field`` in force at the model's version (Join's, or the newest change due), >= 1."""
        settings = self.client.settings
        changes = self.client.session.membership.config_changes  # in the order they were scheduled
        return 1 if settings is None else in_force(settings, changes, self.client.version, field)

    def round_period(self) -> int:
        """Inner steps between outer rounds: H, or H // F with F > 1 fragments (at least 1)."""
        return max(1, self.period() // self.fragments())

    def count_samples(self, n: int) -> None:
        """Add ``n`` samples to this rank's count for the current outer round (diloco's FedAvg weight).

        Raises:
            ValueError: ``n`` is not an integer >= 0.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"count_samples takes the number of samples of a batch, an integer >= 0; got {n!r}.")
        self.samples += n
        self.counting = True
        self.fragment_samples = [c + n for c in self.fragment_samples]

    def counted(self, n: int) -> int | None:
        """The count an outer round sends: ``n`` once this rank counts samples (0: the round weighs
        nothing), None (the field unset: a plain mean) while it never called :meth:`count_samples`."""
        return n if self.counting else None

    def stepped(self) -> None:
        """Count a local step (``ps_worker_local_steps`` too)."""
        self.steps += 1
        if self.client.metrics is not None:
            self.client.metrics.local_steps.inc()

    def step(self, skip: bool) -> int:
        """One ``DistributedOptimizer.step()`` of a local-optimizer mode: diloco's outer rounds are
        sync rounds (:meth:`outer_step`), easgd's exchanges are not (:meth:`easgd_step`)."""
        return self.outer_step(skip) if self.client.worker_mode.pushes_in_rounds else self.easgd_step(skip)

    # ------------------------------------------------------------------ easgd
    def easgd_step(self, skip: bool) -> int:
        """A local step, and every tau steps an exchange with the center (the float buffers are
        averaged elastically too). ``skip``: AMP found inf, nothing is stepped.

        Returns:
            The version of the center after the last exchange.
        """
        if skip:
            return self.client.version
        self.optimizer.step()
        self.stepped()
        if self.steps % self.period():
            return self.client.version
        values = {**{k: p.data for k, p in self.params.items()}, **self.buffer_values()}
        version = self.client.exchange(values)
        with torch.no_grad():
            for k, b in self.buffers.items():
                if b.is_floating_point():  # a counter (num_batches_tracked) stays this rank's own
                    b.copy_(values[k])
        return version

    # ------------------------------------------------------------------ diloco
    def outer_step(self, skip: bool) -> int:
        """An inner step, and every H inner steps an outer round. ``skip``: AMP found inf on this
        rank; the inner step is skipped (as GradScaler skips a step) and counts toward H, so that
        every rank reaches the round at the same step.

        Returns:
            The version of theta_global this rank's round started from, or made (after a round).

        Raises:
            ShardError: the shards refused the round (see ``PSClient.push_pull``).
        """
        if not skip:
            self.optimizer.step()
        self.stepped()
        self.in_round += 1
        if self.in_round < self.round_period():
            return self.client.version
        return self.outer_round() if self.fragments() == 1 else self.fragment_round()

    @torch.no_grad()
    def outer_round(self) -> int:
        """Push ``delta = anchor - theta_local`` (and this rank's buffers; the shards keep rank
        0's) as this round's gradient with the samples counted, pull theta_global into the model
        and make it the new anchor. The outer optimizer's hyperparameters are the shards' own.

        Returns:
            The version the model now holds (the outer rounds done).
        """
        deltas: dict[str, torch.Tensor] = {k: self.anchor[k] - p.detach() for k, p in self.params.items()}
        deltas.update(self.buffer_values())
        client = self.client
        moved = client.pushed_bytes + client.pulled_bytes
        version = client.push_pull(deltas, self.pull_targets(), hyperparameters=[], samples=self.counted(self.samples))
        for k, p in self.params.items():
            self.anchor[k].copy_(p.detach())
        self.in_round = self.samples = 0
        self.buffers_pulled()
        if client.metrics is not None:
            client.metrics.outer_rounds.inc()
            client.metrics.outer_round_bytes.observe(client.pushed_bytes + client.pulled_bytes - moved)
        return version

    @torch.no_grad()
    def fragment_round(self) -> int:
        """Streaming DiLoCo's outer round t: push fragment ``p = t mod F``'s delta (and its buffers)
        with the samples counted since p's last round, on gRPC, only p's partitions; pull p's
        theta_global into the model (alpha = 0: it replaces the local values) and make it p's anchor.
        A buffer outside p keeps this rank's value.

        Returns:
            The version the model now holds (the outer rounds done).
        """
        client, count = self.client, self.fragments()
        base = client.path.require_codec()
        p = round_fragment(client.session.push_round() or 0, count)
        codec = self._codecs.get((base.plan.digest, count, p))
        if codec is None or codec.wire_dtype != base.wire_dtype or codec.compressor is not base.compressor:
            keys = fragment_keys(base.plan, count, p)
            self._codecs = {k: v for k, v in self._codecs.items() if k[0] == base.plan.digest}  # a new plan: drop
            codec = WireCodec(base.plan, base.wire_dtype, base.compressor, keys)
            self._codecs[(base.plan.digest, count, p)] = codec
        keys = codec.keys
        assert keys is not None
        if len(self.fragment_samples) != count:
            self.fragment_samples = [self.samples] * count
        values = self.buffer_values()
        deltas = {k: self.anchor[k] - q.detach() for k, q in self.params.items() if k in keys}
        deltas.update({k: v for k, v in values.items() if k in keys})
        targets = self.pull_targets()
        for k, v in values.items():
            if k not in keys:
                targets[k].copy_(v)  # loaded back as it is
        moved = client.pushed_bytes + client.pulled_bytes
        samples = self.counted(self.fragment_samples[p])
        step = PendingPushPull(client.path, targets, False, [], False, samples, codec=codec)
        for key, t in client.staging.stage(base.plan, deltas, keys).items():
            step.ready(key, t)
        version = step.finish()
        for k, q in self.params.items():
            if k in keys:
                self.anchor[k].copy_(q.detach())
        self.in_round = self.samples = self.fragment_samples[p] = 0
        self.buffers_pulled()
        if client.metrics is not None:
            client.metrics.outer_rounds.inc()
            client.metrics.outer_round_bytes.observe(client.pushed_bytes + client.pulled_bytes - moved)
        return version

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The local steps, diloco's position in its round and samples counted, and the local
        optimizer's state (``DistributedOptimizer.state_dict()['ps']``)."""
        return {
            "local_steps": self.steps,
            "steps_in_round": self.in_round,
            "samples_in_round": self.samples,
            "fragment_samples": list(self.fragment_samples),
            "counts_samples": self.counting,
            "local_optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, extra: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (keys missing keep their values)."""
        self.steps = int(extra.get("local_steps", self.steps))
        self.in_round = int(extra.get("steps_in_round", self.in_round))
        self.samples = int(extra.get("samples_in_round", self.samples))
        self.fragment_samples = [int(n) for n in extra.get("fragment_samples", self.fragment_samples)]
        self.counting = bool(extra.get("counts_samples", self.counting))
        if extra.get("local_optimizer") is not None:
            self.optimizer.load_state_dict(extra["local_optimizer"])
