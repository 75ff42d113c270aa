"""The worker side of the consistency models (``docs/architecture.md#5-consistency``): one object per mode.

The shard decides when an update applies; the worker decides what a step sends and what it waits
for. Each :class:`WorkerMode` says that for one mode, and is looked up by name in
:data:`WORKER_MODES` (:func:`worker_mode`):

- ``sync`` (BSP): a step is one PushPull for the round: the push is stamped with the round (the
  version its gradient was computed on) and the pull waits for the round's result.
- ``async`` (ASP) and ``ssp``: a step pushes, stamped with the worker's clock, then pulls at that
  clock (one PushPull call; the ssp shard holds the pull while this rank is more than s clocks
  ahead of the slowest, Ho et al. 2013).
- ``easgd``: a step is a local optimizer step; every communication period tau the worker
  exchanges its parameters with the center (async EASGD, Zhang, Choromanska, LeCun 2015,
  Algorithm 1); at the end the center is the model.
- ``diloco``: a step is an inner optimizer step; every H steps the worker pushes its outer
  gradient as one sync round (Douillard et al. 2023, Algorithm 1; :mod:`ps_worker.local_sgd`); at
  the end the global parameters are the model.

Every question the worker asks of its mode goes to its :class:`WorkerMode` (which step counter a
training loop follows, the floor of a table pull, whether a rejoin keeps the step's gradient, whether
a resize waits for a round); no other worker module compares mode names.

The mode's parameters come from one place: :func:`settings_from_config` reads the
:class:`~ps_common.modes.ModeSettings` of a Join response's ``ClusterConfig``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import grpc
import torch

from ps_common import modes
from ps_common.errors import StalePushError
from ps_common.modes import ModeSettings
from ps_common.optimizer import OptimizerSpec
from ps_common.outer_rounds import inner_step
from ps_common.wire import MODE_TO_NAME
from ps_proto.v1 import ps_pb2


class Progress(Protocol):
    """What a mode reads and sets of a worker's session (:class:`~ps_worker.session.Session`)."""

    rank: int
    clock: int
    """Completed steps (pushes) of this rank."""
    exchanges: int
    """Completed EASGD exchanges."""
    version: int
    """The lowest of :attr:`versions`."""
    versions: list[int]
    """Per shard, the version this rank last pulled (sync: the round it pushes next)."""
    pushed: list[bool]
    """Per shard, a push of this rank waits in the shard's open round."""

    @property
    def membership(self) -> ps_pb2.MembershipEpoch:
        """The newest membership record this rank knows (its ``config_changes``: the live changes)."""
        ...


class Puller(Protocol):
    """What reads the shards' parameters (:meth:`~ps_worker.client.PSClient.pull`)."""

    def pull(self, out: Mapping[str, torch.Tensor], min_version: int | None = None) -> int: ...


def settings_from_config(config: ps_pb2.ClusterConfig) -> ModeSettings:
    """The mode and its parameters as a shard announced them (Join, and each push's answer).

    Raises:
        InvalidRequestError: the shard sent values out of range.
    """
    return modes.settings_from_config(MODE_TO_NAME[config.mode], config)


class WorkerMode:
    """What a worker's step does in one consistency model. The base is async (ASP)."""

    name = "async"
    local_optimizer = False
    """The step runs a local optimizer (the shards keep a center, not the model)."""
    counts_staleness = True
    """The push's staleness is recorded in ``client.staleness`` (sync pushes are never stale)."""
    pushes_in_rounds = False
    """A push belongs to one round, the same on every shard (sync): every shard counts the rank in
    each round (a table push goes to every shard, empty or not), and a resize waits for its round."""

    def adopt_join(self, session: Progress, replies: Sequence[ps_pb2.JoinResponse]) -> None:
        """Take the progress the shards remember for this rank (a restarted rank resumes there)."""
        session.clock = max(r.clock for r in replies)

    def after_init(self, session: Progress) -> None:
        """Once the initial weights are pulled (``session.version`` is the shards' lowest version)."""

    def shard_optimizer(self, given: OptimizerSpec, settings: ModeSettings) -> OptimizerSpec:
        """The optimizer rank 0's Init sets on the shards, given the one ``client.init`` was given."""
        return given

    def unlike_ddp(self, optimizer: OptimizerSpec, settings: ModeSettings) -> str | None:
        """What this mode's step does that DDP's does not, with ``optimizer`` in force on the shards
        (rank 0 logs it as a warning at start); None: nothing to say."""
        return None

    def push_clock(self, session: Progress, k: int) -> int:
        """The ``clock`` a push to shard ``k`` is stamped with: the step count."""
        return session.clock

    def pull_floor(self, session: Progress, k: int) -> int:
        """The version a pull from shard ``k`` waits for (async, ssp: none; ssp's wait is the shard's)."""
        return 0

    def push_round(self, session: Progress) -> int | None:
        """The round a push made now is for, the same on every shard and fixed for the push, retries
        included (sync); None: the push is stamped with the step count."""
        return None

    def table_pull_floor(self, table_clock: int) -> int:
        """The table version a PullRows waits for, given this rank's next PushRows clock."""
        return 0

    def next_step(self, step: int, version: int) -> int:
        """The training step after ``step``, once the model holds ``version``: the next one."""
        return step + 1

    def resize_pending(self, step: int, resize_version: int) -> bool:
        """Whether the worker count before a resize of version ``resize_version`` still holds at
        ``step`` (the resize applies at once: never)."""
        return False

    def resize_clock(self, session: Progress, step: int) -> int:
        """What :meth:`resize_pending` compares with a resize's version at the loop's ``step``: the
        step itself (sync: the round the rank holds)."""
        return step

    def round_start(self, round: int, settings: ModeSettings, changes: Sequence[ps_pb2.ConfigChange]) -> int:
        """The loop's step at which round (version) ``round`` starts (``changes``: the live ones a
        membership record carries): the round itself."""
        return round

    def after_rejoin(
        self, session: Progress, k: int, reply: ps_pb2.JoinResponse, round: int | None, address: str
    ) -> None:
        """Check a rejoin of shard ``k`` during a recovery (``reply``: its Join answer; ``round``:
        the round the recovered call pushes, or None). Nothing to check but in sync."""

    def shard_clock(self, session: Progress) -> int:
        """The count the shards keep for this rank (Join's ``clock``): its pushes."""
        return session.clock

    def progress(self, session: Progress, settings: ModeSettings) -> int:
        """The training step this rank is at (where a restarted rank resumes)."""
        return session.clock

    def finish(self, client: Puller, model: torch.nn.Module) -> None:
        """After the last step: make ``model`` the model the job trained (nothing to do but in easgd)."""


def unaveraged(mode: str, optimizer: OptimizerSpec, settings: ModeSettings, staleness_lr: bool) -> str | None:
    """async and ssp: each rank's push is its own optimizer step, not 1/N of an averaged one as
    under DDP, so N ranks move the parameters about N times as far per sample at the same lr, and
    the gradients' staleness acts as extra momentum (Mitliagkas, Zhang, Hadjis, Re 2016,
    "Asynchrony begets momentum"). ``staleness_lr``: the mode follows ``--staleness-lr`` (async).
    None with one rank, or with ``--staleness-lr inverse`` in force."""
    n = settings.num_workers
    if n < 2 or (staleness_lr and settings.staleness_lr == "inverse"):
        return None
    lr = optimizer.kwargs["lr"]
    momentum = f" (momentum {optimizer.kwargs['momentum']:g})" if "momentum" in optimizer.kwargs else ""
    return (
        f"{mode}: each of the {n} ranks' pushes is its own optimizer step at lr {lr:g}{momentum}; DDP "
        f"takes one step of their averaged gradient. At DDP's lr the parameters move {n}x as far per sample and stale "
        "gradients add momentum (Mitliagkas et al. 2016), which can diverge: use DDP's lr divided by "
        f"{n} (the linear scaling rule, Goyal et al. 2017)"
        + (" or start the shards with --staleness-lr inverse" if staleness_lr else "")
    )


class Asynchronous(WorkerMode):
    """ASP: each push is one optimizer step on the shards at once; pulls never wait."""

    name = "async"

    def unlike_ddp(self, optimizer: OptimizerSpec, settings: ModeSettings) -> str | None:
        return unaveraged(self.name, optimizer, settings, staleness_lr=True)


class StaleSynchronous(WorkerMode):
    """SSP with bound s: as async; the shard holds a pull at clock c until the slowest live
    worker's clock is >= c - s (Ho et al. 2013)."""

    name = "ssp"

    def unlike_ddp(self, optimizer: OptimizerSpec, settings: ModeSettings) -> str | None:
        return unaveraged(self.name, optimizer, settings, staleness_lr=False)


class Synchronous(WorkerMode):
    """BSP: a push joins the round of the version its gradient was computed on: the lowest version
    among the shards, on every shard, so that a rank never pushes different rounds to different
    shards (a shard ahead refuses it as stale until a shard behind — restored from an older
    checkpoint, or closing a round the rank was counted again after — has caught up); the pull
    waits for that round."""

    name = "sync"
    counts_staleness = False
    pushes_in_rounds = True

    def adopt_join(self, session: Progress, replies: Sequence[ps_pb2.JoinResponse]) -> None:
        """The round each shard takes this rank's push in next (a rank counted again after an
        eviction: shard 0's next round, on every shard): the first pull waits for it."""
        super().adopt_join(session, replies)
        session.versions = [int(r.clock) for r in replies]

    def after_init(self, session: Progress) -> None:
        session.clock = max(session.clock, session.version)

    def push_clock(self, session: Progress, k: int) -> int:
        return min(session.versions)

    def pull_floor(self, session: Progress, k: int) -> int:
        return session.versions[k] + 1 if session.pushed[k] else session.versions[k]

    def push_round(self, session: Progress) -> int | None:
        return self.push_clock(session, 0)

    def table_pull_floor(self, table_clock: int) -> int:
        """The table round this rank pushes next: its result."""
        return table_clock

    def next_step(self, step: int, version: int) -> int:
        """The round the rank holds next, the same on every rank (a refused push does not move it;
        a rank counted again from a later round skips to it)."""
        return version

    def resize_pending(self, step: int, resize_version: int) -> bool:
        """The resize holds from its round on."""
        return step < resize_version

    def after_rejoin(
        self, session: Progress, k: int, reply: ps_pb2.JoinResponse, round: int | None, address: str
    ) -> None:
        """A push stamped for one round is never sent again for another.

        Raises:
            StalePushError: the rank was counted again from a later round than the shard's (a rejoin
                after an eviction: ``versions[k]`` becomes that round, the pull waits for it), or
                the shard takes this rank's push in another round than ``round`` now (it restarted
                from an older checkpoint): the step's gradient is dropped.
        """
        if reply.clock > reply.version:
            # counted again from a later round, on every shard (shard 0 decided): this step's
            # gradient is for a round that goes on without this rank; wait for that round's result
            session.versions[k] = int(reply.clock)
            raise StalePushError.answered(
                address,
                grpc.StatusCode.ABORTED,
                f"rank {session.rank} rejoined and counts from round {reply.clock}: this step's gradient is dropped",
            )
        if round is not None and int(reply.clock) != round:
            # the gradient was computed for ``round``; pushed again, it would be stamped for another
            # round on this shard than on the others (the shards would close rounds differently)
            raise StalePushError.answered(
                address,
                grpc.StatusCode.ABORTED,
                f"rank {session.rank}'s push for round {round} cannot be taken by shard {address} any more: "
                f"it takes this rank's push in round {reply.clock} now; this step's gradient is dropped",
            )


class ElasticAveraging(WorkerMode):
    """EASGD: local steps, and an exchange with the center every communication period tau
    (Zhang, Choromanska, LeCun 2015, Algorithm 1; eqs. 5-6 with ``--easgd-sync``)."""

    name = "easgd"
    local_optimizer = True

    def adopt_join(self, session: Progress, replies: Sequence[ps_pb2.JoinResponse]) -> None:
        session.exchanges = max(r.clock for r in replies)

    def shard_clock(self, session: Progress) -> int:
        """Its exchanges."""
        return session.exchanges

    def progress(self, session: Progress, settings: ModeSettings) -> int:
        return session.exchanges * settings.communication_period

    def finish(self, client: Puller, model: torch.nn.Module) -> None:
        """The center is EASGD's model; local x only explores around it: pull it into ``model``."""
        client.pull({k: p.data for k, p in model.named_parameters()})


class LocalSgd(Synchronous):
    """DiLoCo / FedAvg: inner steps of the script's optimizer, and every H steps an outer round,
    which is a sync round (its stamping, waits and rejoin rules are sync's): the rank pushes
    ``theta_global - theta_local`` and pulls the outer optimizer's result."""

    name = "diloco"
    local_optimizer = True

    def shard_optimizer(self, given: OptimizerSpec, settings: ModeSettings) -> OptimizerSpec:
        """The outer optimizer (``--outer-optimizer``); the one given steps locally (the inner steps)."""
        spec = modes.outer_optimizer_json(settings.outer_optimizer)
        kwargs = {k: float(v) for k, v in spec.items() if k != "name"}
        return OptimizerSpec(str(spec["name"]), kwargs, (), given.buffers)

    def progress(self, session: Progress, settings: ModeSettings) -> int:
        """The inner step the open outer round starts at, where a restarted rank resumes: the rounds
        done counted in H // F inner steps each, with the H and F in force at each round
        (:func:`ps_common.outer_rounds.inner_step`, from the changes the membership record carries),
        not today's."""
        return inner_step(settings, session.membership.config_changes, session.version)

    def next_step(self, step: int, version: int) -> int:
        """The next inner step (a loop counts inner steps, not rounds)."""
        return step + 1

    def resize_clock(self, session: Progress, step: int) -> int:
        """The outer round the rank's inner steps lead to (the round its next push is for): a resize
        from round V holds from the inner steps whose push is for round V on, on every rank."""
        return self.push_clock(session, 0)

    def round_start(self, round: int, settings: ModeSettings, changes: Sequence[ps_pb2.ConfigChange]) -> int:
        """The inner step outer round ``round`` starts at (:func:`ps_common.outer_rounds.inner_step`:
        ``round * H // F`` until a live change of H or F, counted round by round after it)."""
        return inner_step(settings, changes, round)

    def finish(self, client: Puller, model: torch.nn.Module) -> None:
        """theta_global is the model (the inner steps after the last outer round are dropped, so
        every rank ends with the same model): pull it into ``model``."""
        client.pull({k: p.data for k, p in model.named_parameters()})


WORKER_MODES: dict[str, WorkerMode] = {
    m.name: m for m in (Synchronous(), Asynchronous(), StaleSynchronous(), ElasticAveraging(), LocalSgd())
}
"""Mode name (``ps_common.modes.MODES``) -> its worker side."""


def worker_mode(name: str) -> WorkerMode:
    """The worker side of mode ``name``; before a Join (``""``), async's (no waits, step count).

    Raises:
        ValueError: an unknown mode.
    """
    if not name:
        return WORKER_MODES["async"]
    try:
        return WORKER_MODES[name]
    except KeyError:
        raise ValueError(f"Unknown mode {name!r}; expected one of {', '.join(sorted(WORKER_MODES))}.") from None
