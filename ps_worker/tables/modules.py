"""Embedding tables in a user's model: sparse ``nn.Embedding``/``nn.EmbeddingBag`` modules (and
:class:`ShardedEmbedding`) served row by row by the shards (docs/tables.md).

:func:`attach_tables` (called by ``PSClient.init`` before the plan is built) finds every
``nn.Embedding(..., sparse=True)``, ``nn.EmbeddingBag(..., sparse=True)`` and
:class:`ShardedEmbedding` of the model, removes its ``weight`` parameter (so the dense plan, Init and
PushPull never see the table and no worker keeps a copy of it) and replaces its ``forward``: each
forward pulls the distinct ids of its input from the shards (one PullRows per shard owning any),
runs ``F.embedding``/``F.embedding_bag`` on those rows (a leaf tensor [distinct ids, dim]) and
remembers them; ``DistributedOptimizer.step()`` pushes their gradients (:func:`push_step`) before
the dense step. Build a large table on the meta device (``nn.Embedding(10**7, 64, sparse=True,
device="meta")``) or as ``ShardedEmbedding(10**7, 64)`` so it is never allocated at all.

The table's name is the module's parameter name (``"emb.weight"``). Its rows start from the
module's own weight when it holds one (not on the meta device) and the table has no admission,
expiry or byte bound: rank 0 seeds them (InitTables rows, ``ps_worker.tables.seed``), so a model's
own initializer (DLRM's U(+-1/sqrt(rows)), a ``load_state_dict`` before ``client.init``) holds as
under DDP. Otherwise they start from the declared initializer, N(0, init_std**2) of (name, seed, id)
(``ps_common.tables.initial_rows``), or U(low, high) with ``module.ps_init = ("uniform", low, high)``;
``module.ps_init = "weight" | "declared"`` chooses (docs/tables.md).
A module may set ``ps_seed``/``ps_init_std`` attributes, and ``ps_table_options`` (a dict of
``TableSpec``'s ``admit_after``, ``expire_after_rounds``, ``expire_after_seconds``, ``max_bytes``,
``on_full``: docs/tables.md). ``model.state_dict()`` holds the tables' rows (``ps_worker.tables.state``). The row
optimizer is ``optimizer["sparse"]`` (``{"name": "adagrad", "lr": 0.05}``) or, without it, the dense
optimizer's name and the arguments a row optimizer takes (sgd, adagrad, adam/adamw -> lazy adam).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ps_common.frames import MESSAGE_OVERHEAD_BYTES
from ps_common.tables import DENSE_TO_ROW, ROW_OPTIMIZERS, RowOptimizerSpec, TableSpec
from ps_worker.tables.client import TableClient
from ps_worker.tables.state import attach_state

if TYPE_CHECKING:
    from ps_worker.metrics import WorkerMetrics
    from ps_worker.session import Session
    from ps_worker.transport.grpc_link import Transport

log = logging.getLogger(__name__)


class TableHost(Protocol):
    """What the tables are attached to and served through (:class:`~ps_worker.client.PSClient`)."""

    partition_bytes: int
    """The largest partition payload of the client's messages, bytes."""
    transport: Transport
    session: Session
    metrics: WorkerMetrics | None
    tables: TableClient | None
    on_close: list[Callable[[], None]]


class ShardedEmbedding(nn.Module):
    """An embedding table that lives on the shards only: ``nn.Embedding`` (``mode=None``) or
    ``nn.EmbeddingBag`` (``mode`` "sum", "mean" or "max") without any local weight.

    Args:
        num_rows: ids are int64 in ``[0, num_rows)``, up to ``2**63 - 1``.
        dim: elements per row.
        mode: None (one row per id, output ``[*input.shape, dim]``) or a bag reduction.
        seed, init_std: initial rows N(0, init_std**2), a function of (name, seed, id).
        init: ``("uniform", low, high)`` for rows U(low, high) instead (``ps_init``).

    Forward (after ``client.init``): ``input`` int64 ids; bags take ``offsets`` and
    ``per_sample_weights`` as ``nn.EmbeddingBag``. Output float32.
    """

    def __init__(
        self,
        num_rows: int,
        dim: int,
        mode: str | None = None,
        *,
        seed: int = 0,
        init_std: float = 1.0,
        init: tuple[str, float, float] | None = None,
    ):
        super().__init__()
        if mode not in (None, "sum", "mean", "max"):
            raise ValueError(f"mode must be None, 'sum', 'mean' or 'max', got {mode!r}.")
        self.num_embeddings, self.embedding_dim, self.mode = num_rows, dim, mode
        self.include_last_offset = False
        self.ps_seed, self.ps_init_std, self.ps_init = seed, init_std, init

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: Any = None):
        raise RuntimeError("ShardedEmbedding serves rows from the shards: call client.init(model, ...) first.")


def is_table(module: nn.Module) -> bool:
    """True for a module :func:`attach_tables` serves from the shards (a sparse embedding)."""
    if isinstance(module, ShardedEmbedding):
        return True
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and bool(module.sparse)


def table_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Table name (``"emb.weight"``) -> the weight of each sparse embedding of ``model`` still
    holding one (before :func:`attach_tables`; a :class:`ShardedEmbedding` has none)."""
    out = {}
    for name, m in model.named_modules():
        weight = m._parameters.get("weight") if is_table(m) else None
        if weight is not None:
            out[f"{name}.weight" if name else "weight"] = weight
    return out


def row_optimizer(optimizer: Mapping[str, Any] | None) -> tuple[dict[str, Any], RowOptimizerSpec]:
    """Split a client.init optimizer spec into the dense one and the tables' row optimizer.

    Raises:
        ValueError: the dense optimizer has no row-wise form and no ``"sparse"`` entry names one.
    """
    dense = dict(optimizer or {"name": "sgd", "lr": 0.1})
    sparse = dense.pop("sparse", None)
    if sparse is not None:
        spec = dict(sparse)
        name = DENSE_TO_ROW.get(str(spec.pop("name")), "")
        return dense, RowOptimizerSpec(name or str(sparse["name"]), {k: float(v) for k, v in spec.items()})
    row_name = DENSE_TO_ROW.get(str(dense.get("name")))
    if row_name is None:
        raise ValueError(
            f"The dense optimizer {dense.get('name')!r} has no row-wise form for embedding tables; add "
            f"optimizer['sparse'] = {{'name': one of {sorted(ROW_OPTIMIZERS)}, 'lr': ...}}."
        )
    allowed = ROW_OPTIMIZERS[row_name]
    return dense, RowOptimizerSpec(row_name, {k: float(v) for k, v in dense.items() if k in allowed})


INITIAL_ROWS = ("weight", "declared")
"""Where a table's rows start (``module.ps_init``): the module's weight, seeded by rank 0, or the
declared initializer the shards compute per row (``ps_common.tables.initial_rows``)."""


def declared_initializer(name: str, module: nn.Module) -> dict[str, Any]:
    """The ``TableSpec`` fields of a module's declared initializer: ``ps_init = ("uniform", low, high)``
    (rows U(low, high)), ``("normal", std)``, or else N(0, ``ps_init_std``**2) (1.0 by default).

    Raises:
        ValueError: a ``ps_init`` tuple of another form.
    """
    init, std = getattr(module, "ps_init", None), float(getattr(module, "ps_init_std", 1.0))
    if not isinstance(init, (tuple, list)):
        return {"init_std": std}
    if len(init) == 3 and init[0] == "uniform":
        return {"init_std": std, "initializer": "uniform", "init_low": float(init[1]), "init_high": float(init[2])}
    if len(init) == 2 and init[0] == "normal":
        return {"init_std": float(init[1])}
    raise ValueError(f"{name}: ps_init takes ('normal', std) or ('uniform', low, high), got {tuple(init)!r}.")


def initial_rows_from(name: str, module: nn.Module, spec: TableSpec) -> str:
    """``"weight"`` or ``"declared"``: where table ``spec``'s rows start (the module docstring).

    Raises:
        ValueError: ``module.ps_init`` is neither, or ``"weight"`` for a module without a weight
            (on the meta device, or a :class:`ShardedEmbedding`).
    """
    weight = dict(module.named_parameters(recurse=False)).get("weight")
    held = weight is not None and not weight.is_meta
    choice = getattr(module, "ps_init", None)
    if choice is None:  # a table that drops rows reads them back at the declared value: declared
        return "weight" if held and not (spec.admits or spec.expires or spec.max_bytes) else "declared"
    if isinstance(choice, (tuple, list)):  # ("uniform", low, high) or ("normal", std): declared_initializer
        return "declared"
    if choice not in INITIAL_ROWS:
        raise ValueError(
            f"{name}: ps_init must be one of {', '.join(INITIAL_ROWS)}, ('normal', std) or ('uniform', low, high), "
            f"got {choice!r}."
        )
    if choice == "weight" and not held:
        raise ValueError(
            f"{name}: ps_init='weight' needs a module holding its weight (not on the meta device, not a "
            "ShardedEmbedding); use ps_init='declared' (rows N(0, ps_init_std**2) computed by the shards)."
        )
    return str(choice)


def attach_tables(client: TableHost, model: nn.Module, optimizer: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """Make the model's sparse embeddings shard-served tables (see the module docstring).

    Returns:
        The dense optimizer spec (``optimizer`` without ``"sparse"``).

    Raises:
        ValueError: an embedding option tables do not support (max_norm, padding_idx,
            scale_grad_by_freq), no row optimizer (see :func:`row_optimizer`), a bad ``ps_init``
            (:func:`initial_rows_from`); the model is left as it was.
    """
    found = [(name, m) for name, m in model.named_modules() if is_table(m)]
    if not found:
        if optimizer is not None and "sparse" in optimizer:
            return {k: v for k, v in optimizer.items() if k != "sparse"}
        return optimizer
    dense, row_opt = row_optimizer(optimizer)
    specs, origins = [], []
    for name, m in found:
        for option, off in (("max_norm", None), ("padding_idx", None), ("scale_grad_by_freq", False)):
            if getattr(m, option, off) != off:
                raise ValueError(
                    f"{name}: {option}={getattr(m, option)!r} is not supported for a sharded table; leave it at {off}."
                )
        table = f"{name}.weight" if name else "weight"
        seed = int(getattr(m, "ps_seed", 0))
        options = dict(getattr(m, "ps_table_options", {}))  # admit_after, expire_after_*, max_bytes, on_full
        try:
            rows, dim = int(m.num_embeddings), int(m.embedding_dim)
            specs.append(TableSpec(table, rows, dim, row_opt, seed, **declared_initializer(name, m), **options))
        except TypeError as exc:
            raise ValueError(f"{name}: ps_table_options takes TableSpec's lifetime fields; {exc}") from exc
        origins.append(initial_rows_from(name, m, specs[-1]))  # ValueError before any module changes
    limit = client.partition_bytes + MESSAGE_OVERHEAD_BYTES  # what the client's channels carry
    tables = TableClient(client.transport, client.session, specs, client.metrics, limit)
    for (_, m), spec, origin in zip(found, specs, origins, strict=True):
        seed = getattr(m, "ps_seed_rows", None)  # a model file's rows (ps_worker.model_file.init_from) win
        if seed is None and origin == "weight" and client.session.rank == 0:  # DDP broadcasts rank 0's too
            weight = m._parameters["weight"].detach()  # on the CPU in float32 already: not copied
            seed = (torch.arange(spec.num_rows, dtype=torch.int64), weight.to("cpu", torch.float32))
        if seed is not None and client.session.rank == 0:  # the other ranks drop theirs
            tables.seeds = {**tables.seeds, spec.name: seed}
        object.__setattr__(m, "ps_seed_rows", None)
        if "weight" in m._parameters:
            attach_state(m, tables, spec.name)  # model.state_dict() gathers its rows (ps_worker.tables.state)
            tables.weights[spec.name] = weakref.ref(m._parameters["weight"])  # a user optimizer's, by identity
            del m._parameters["weight"]  # the table is the shards'; nothing of it stays here
            object.__setattr__(m, "weight", None)
        m.forward = functools.partial(_forward, m, tables, spec.name)  # type: ignore[method-assign]
        object.__setattr__(m, "ps_table", spec.name)  # what ps_worker.tables.prefetch knows the module by
    client.tables = tables
    client.on_close.append(tables.close)
    # the row optimizer derived from the dense one: a user may build a SparseAdam over the tables next,
    # which torch refuses ("empty parameter list") without a word of why: say it before
    log.log(
        logging.INFO if "sparse" in (optimizer or {}) else logging.WARNING,
        "embedding tables %s live on the shards and left model.parameters(): build any optimizer over them "
        "before client.init and pass it too, e.g. optimizer=[adam, SparseAdam(emb.parameters())] (row "
        "optimizer now: %s %s)",
        ", ".join(s.name for s in specs),
        row_opt.name,
        dict(row_opt.kwargs),
    )
    return dense


def _forward(
    module: nn.Module,
    tables: TableClient,
    table: str,
    input: torch.Tensor,
    offsets: torch.Tensor | None = None,
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """A table module's forward: pull the input's distinct rows, look up in them."""
    unique, inverse = torch.unique(input.detach().reshape(-1).cpu().to(torch.int64), return_inverse=True)
    ahead = tables.prefetched.pop(table, None)
    fetched = tables.ahead.take(table, unique) if torch.is_grad_enabled() else None  # a RowPrefetcher's
    if fetched is not None:
        rows = fetched.to(input.device)
    elif ahead is not None and torch.equal(ahead[0], unique):
        rows = ahead[1].to(input.device)  # pulled by prefetch() together with the other tables
    else:
        rows = tables.pull({table: unique})[table].to(input.device)
    if torch.is_grad_enabled():
        rows.requires_grad_(True)
        tables.lookups.append((table, unique, rows))
    local = inverse.reshape(input.shape).to(input.device)
    mode = getattr(module, "mode", None)
    if isinstance(module, nn.EmbeddingBag) or mode is not None:
        return F.embedding_bag(
            local,
            rows,
            offsets,
            mode=str(mode or "mean"),
            per_sample_weights=per_sample_weights,
            include_last_offset=bool(getattr(module, "include_last_offset", False)),
        )
    return F.embedding(local, rows)


def prefetch(client: TableHost, ids: Mapping[str, torch.Tensor]) -> None:
    """Pull the rows the next forward of several table modules needs in one PullRows per shard
    (instead of one per module and shard): each module's next forward whose input has exactly
    these distinct ids uses them without a call of its own (any other input pulls as usual).

    Args:
        ids: table name (the module's parameter name, ``"emb.weight"``) -> the int64 ids its next
            forward looks up (any shape, duplicates allowed).

    Raises:
        RuntimeError: the client has no tables. ShardError: as :meth:`TableClient.pull`.
    """
    tables = client.tables
    if tables is None:
        raise RuntimeError("No embedding tables: call client.init(model, ...) with a model that has some first.")
    unique = {t: torch.unique(i.detach().reshape(-1).cpu().to(torch.int64)) for t, i in ids.items()}
    rows = tables.pull(unique)
    tables.prefetched = {t: (unique[t], rows[t]) for t in unique}


def push_step(tables: TableClient, scale: torch.Tensor | float | None = None, skip: bool = False) -> Callable[[], int]:
    """Push the row gradients of the lookups since the last step (one PushRows per shard), then
    forget them. ``scale`` multiplies them (a GradScaler's 1/scale); ``skip`` pushes none (the
    sync round still counts this rank). With a :class:`~ps_worker.tables.prefetch.RowPrefetcher`
    naming the next batch's ids, the push runs on the prefetch thread, followed by the pull of those
    rows, while the caller goes on (the dense step).

    Returns:
        A callable that waits for the push and returns the table version the shards answered
        (sync: the round joined), or raises the push's error (ShardError, ValueError: as
        :meth:`TableClient.push`).
    """
    parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
    lookups = tables.lookups
    for table, unique, rows in lookups:
        if rows.grad is not None and not skip:
            g = rows.grad.detach().to("cpu", torch.float32)
            parts[table].append((unique, g * scale.cpu() if isinstance(scale, torch.Tensor) else g * (scale or 1.0)))
    lookups.clear()
    tables.prefetched = {}
    grads = {t: (torch.cat([i for i, _ in ps]), torch.cat([g for _, g in ps])) for t, ps in parts.items()}
    if tables.ahead.next_ids is None:
        tables.ahead.drop()  # rows pulled before this push would be a version behind
        version = tables.push(grads)
        return lambda: version
    hyper = tables.hyperparameters() if tables.hyperparameters is not None else None  # read on this thread
    pushed = tables.ahead.push_then_pull(lambda each_shard: tables.push(grads, hyper, each_shard))
    return pushed.result


def join_then_seed(client: TableHost, join: Callable[[], Any]) -> Callable[[], Any]:
    """``join``, then, on rank 0 with seed rows (``TableClient.seeds``), the tables declared and
    seeded at once, before rank 0's dense Init: the other ranks wait for that Init, so none reads a
    row before it is seeded. Otherwise ``join`` itself (tables are declared at the first pull)."""
    tables = client.tables
    if tables is None or not tables.seeds or client.session.rank != 0:
        return join

    def joined() -> Any:
        replies = join()
        tables.declare()
        return replies

    return joined
