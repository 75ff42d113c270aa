"""The one interface of the consistency models (docs/architecture.md#5-consistency): what a shard asks its mode.

A :class:`ConsistencyPolicy` decides, for the :class:`~ps_server.shard.shard.Shard` that holds the lock,
what happens to a push (applied now, held for its round, or refused as stale, and with which
learning-rate scale), when a round or an EASGD period closes, whether a read can be served, where a
rejoining rank resumes, why a read is blocked, and what staleness means in the mode. The shard keeps
the lock, the waits, idempotence and membership; every ``mode`` decision is a method here. Policies
hold no state of their own (the shard's state is passed in), so one instance per mode serves every
shard (:data:`ps_server.policy.POLICIES`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from ps_common.errors import PreconditionError, UpdateRefusedError
from ps_common.modes import ModeSettings
from ps_server.membership.ranks import Member, Membership, PushResult, PushStamp
from ps_server.policy.types import Awaited, ClipHook, Hyperparameters, StreamHook

if TYPE_CHECKING:
    from ps_common.plan import Plan
    from ps_server.policy.rounds import SyncRounds
    from ps_server.shard.counters import ShardCounters
    from ps_server.shard.store import ParameterStore


class ShardCore(Protocol):
    """The state of a shard that its policy reads and changes (the caller holds the shard's lock);
    the shard's collaborators see it so too (``ps_server.shard``), with the policy in force."""

    shard_index: int
    settings: ModeSettings
    version: int
    plan: Plan | None
    store: ParameterStore | None
    rounds: SyncRounds
    round_opened: float | None
    round_reported: bool
    max_clock_gap: int
    refusals: dict[int, UpdateRefusedError]
    lost_round: str
    skipped_rounds: dict[int, None]
    exchange_results: dict[int, tuple[int, list[torch.Tensor]]]
    counters: ShardCounters

    @property
    def membership(self) -> Membership: ...

    @property
    def clips(self) -> ClipHook:
        """Rounds held for clipping (``ps_server.shard.clipping``)."""

    @property
    def members(self) -> list[Member]: ...

    @property
    def stream(self) -> StreamHook | None:
        """The sync round being streamed slot by slot, if any (``ps_server.shard.round_stream``)."""

    @property
    def mode(self) -> str: ...

    @property
    def policy(self) -> ConsistencyPolicy:
        """The consistency model in force."""

    def now(self) -> float:
        """Monotonic seconds."""

    def notify(self) -> None:
        """Wake every wait on the shard's lock."""

    def record(self, member: Member, stamp: PushStamp, result: PushResult) -> None:
        """Account an accepted push: clock, pushes, lease, the answer to its repeats."""

    def set_version(self, version: int) -> None:
        """Advance the version (and offer a snapshot at every ``checkpoint_every``-th)."""

    def refusal(self, exc: UpdateRefusedError, what: str, count: int) -> UpdateRefusedError:
        """Count ``count`` refused pushes; the refusal of ``what`` as the ranks are told it."""

    def refuse_round(self, held: dict[int, Sequence[torch.Tensor]], exc: UpdateRefusedError) -> None:
        """Reopen the complete round ``held`` empty and leave each of its ranks ``exc``."""

    def advance(self) -> None:
        """Let the policy close what is complete, switch a pending mode, wake the waiters."""

    def wait_for_ranks(
        self,
        ready: Callable[[], bool],
        deadline: float | None,
        describe: Callable[[], str],
        awaited: Callable[[], Awaited | None] | None = None,
    ) -> None:
        """Wait on the shard's condition until ``ready()`` (see ``Shard.wait_for_ranks``)."""


class ConsistencyPolicy(ABC):
    """One consistency model. Every method runs under the shard's lock and raises domain errors only.

    Class attributes:
        mode: the ``--mode`` name.
        staleness_unit: what :meth:`staleness` counts in this mode (docs/architecture.md#3-staleness): ``"versions"``
            (async), ``"clocks"`` (ssp: the clock gap), ``""`` where nothing is stale (sync, easgd).
        holds_pushes: pushes wait for their round (sync): a closed round refuses its clocks itself
            (no high-water mark), and a refused round is told to the pushes that completed it.
        exchanges: workers call Exchange, not Push (easgd).
        resizable: the cluster may be resized while it trains (``ps-admin resize``); False where a
            round needs a fixed set of ranks (easgd's periods).
        row_rounds: embedding-table row pushes join table rounds (sync): a PushRows of clock ``t``
            is held for table round ``t`` (= the table version) until every expected rank pushed
            it, then the round is one row step. Otherwise each PushRows is one row step at once,
            applied at most once per (rank, incarnation, clock) by a per-rank high-water mark
            (``ps_server.tables.store``).
    """

    mode: ClassVar[str]
    staleness_unit: ClassVar[str] = ""
    holds_pushes: ClassVar[bool] = False
    exchanges: ClassVar[bool] = False
    resizable: ClassVar[bool] = True
    row_rounds: ClassVar[bool] = False

    # ----------------------------------------------------------------- pushes
    @abstractmethod
    def accept(
        self,
        shard: ShardCore,
        member: Member,
        stamp: PushStamp,
        grad_version: int,
        grads: Sequence[torch.Tensor],
        hyper: Hyperparameters = (),
        skip: bool = False,
    ) -> PushResult:
        """Apply ``member``'s push now, hold it for its round, or refuse it; account it.

        Args:
            stamp: who pushed which clock. grad_version: the version the gradients were computed on.
            grads: one 1-D tensor per partition of the shard, in plan order (the store's dtypes).
            hyper, skip: as ``Shard.push``.

        Raises:
            StalePushError: too stale (async), a closed round (sync, no quorum).
            UpdateRefusedError: the step was refused; nothing changed.
            PreconditionError: the mode takes no pushes (easgd).
        """

    def read_after_push(self, clock: int) -> int:
        """The version a PushPull of ``clock`` reads (0: whatever the shard holds)."""
        return 0

    # ----------------------------------------------------------------- rounds
    def advance(self, shard: ShardCore) -> None:
        """Close a complete round or EASGD period, if one is (nothing in async and ssp)."""
        return None

    def quorum(self, settings: ModeSettings) -> int:
        """Pushes that close a round whoever sent them (0: every expected rank); ranks that never
        joined are then not "missing" while the others can still close rounds."""
        return 0

    def on_switch(self, shard: ShardCore) -> None:
        """The shard just switched into this mode at a round boundary (the rounds restart at its version)."""
        return None

    def may_stream(self, settings: ModeSettings) -> bool:
        """Whether a round may be stepped slot by slot while its pushes arrive
        (``ps_server.shard.round_stream``): only a round that closes whole, with every expected rank."""
        return False

    # ----------------------------------------------------------------- membership
    def join_clock(self, shard: ShardCore, member: Member, restarted: bool) -> int:
        """The clock ``member`` resumes at when it joins (``restarted``: under a new incarnation)."""
        return member.clock

    # ----------------------------------------------------------------- reads
    def check_read(self, shard: ShardCore, member: Member, joined: bool, min_version: int) -> None:
        """Before a read waits: raise what the reader must be told at once (a refused round)."""
        return None

    def can_read(self, shard: ShardCore, member: Member, joined: bool, min_version: int) -> bool:
        """True when the read of ``member`` (``joined``: live under its incarnation) can be served."""
        return True

    def blocked(self, shard: ShardCore, member: Member, min_version: int, timeout: float | None) -> str:
        """Why the read is blocked, for the timeout's message (what to check)."""
        waiting = shard.rounds.waiting_for(shard.membership.counted_in(shard.rounds.round))
        return (
            f"Version {min_version} not reached {'in time' if timeout is None else f'in {timeout:.1f} s'} "
            f"(shard {shard.shard_index} is at "
            f"{shard.version}; round waits for ranks {waiting}); "
            "check those workers."
        )

    def awaited(self, shard: ShardCore, member: Member, min_version: int) -> Awaited | None:
        """Whom a blocked read of ``member`` waits for (the ranks that have not pushed the open
        round, here), or None when it waits for no rank."""
        round_ = shard.rounds.round
        return Awaited(f"round {round_}", shard.rounds.waiting_for(shard.membership.counted_in(round_)), "pushed")

    def after_read(self, shard: ShardCore, member: Member, joined: bool, min_version: int) -> None:
        """After the wait, before the parameters are copied: raise a refusal the wait ended on, or
        account the read (ssp's clock gap)."""
        return None

    def staleness(self, shard: ShardCore, member: Member, grad_version: int) -> int:
        """The staleness of ``member`` in :attr:`staleness_unit` (0 where nothing is stale)."""
        return 0

    # ----------------------------------------------------------------- exchanges
    def check_exchange(self) -> None:
        """Raises PreconditionError unless the mode takes exchanges (checked before anything else)."""
        if not self.exchanges:
            raise PreconditionError(f"Exchange is for easgd; this cluster runs {self.mode}: push and pull.")

    def exchange(
        self, shard: ShardCore, member: Member, stamp: PushStamp, x: Sequence[torch.Tensor], deadline: float | None
    ) -> tuple[int, list[torch.Tensor]]:
        """EASGD: take ``member``'s parameters x; returns (version, d = alpha (x - center)).

        Raises:
            PreconditionError: the mode has no exchanges.
        """
        raise PreconditionError(f"Exchange is for easgd; this cluster runs {self.mode}: push and pull.")

    # ----------------------------------------------------------------- embedding tables
    def check_rows(self) -> None:
        """Raises PreconditionError where the mode serves no embedding tables (checked before a
        PushRows is held or applied)."""
        return None

    def row_clock(self, table_version: int, last_clock: int | None) -> int:
        """The clock a rank's next PushRows carries (InitTables answers it).

        Args:
            table_version: the tables' version (with :attr:`row_rounds`: the open table round).
            last_clock: the rank's high-water mark under its incarnation (None: no row push yet).
        """
        return 0 if last_clock is None else last_clock + 1
