"""Embedding tables both sides agree on: the spec, the row -> shard map, the row initializer and
the row-optimizer allowlist (docs/tables.md).

A table is ``num_rows`` rows of ``dim`` float32 elements; row ids are int64 in ``[0, num_rows)``
(``num_rows`` up to ``2**63 - 1``; ids need not be dense). Row ``r`` lives on shard
``mix64(r ^ SHARD_SALT) % num_shards`` (:func:`shard_of`), where ``mix64`` is the SplitMix64
finalizer (Steele, Lea, Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014), a
fixed function of the id (never Python's salted ``hash``). A row never updated reads as
:func:`initial_rows` (the spec's declared initializer), a function of (table name, seed, row id)
only, so any shard count gives the same values. Pure numpy/torch: no grpc.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from ps_common.errors import InvalidRequestError
from ps_common.optimizer import check_hyperparameter_range

MAX_ROWS = 2**63 - 1
"""Largest ``num_rows`` of a table (ids are int64)."""

MAX_DIM = 65536
"""Most elements of one row."""

MAX_TABLES = 64
"""Most tables one model declares."""

MAX_NAME_CHARS = 256

MAX_ADMIT_AFTER = 255
"""Largest ``admit_after`` (the admission filter counts in saturating bytes)."""

ON_FULL = ("refuse", "evict_lru")
"""What a table does when a push needs rows beyond its bound: refuse it (``TABLE_FULL``, the
default) or evict the least recently pushed rows (``max_bytes`` required)."""

ROW_OPTIMIZERS: dict[str, dict[str, tuple[float, float]]] = {
    "sgd": {"lr": (0.0, math.inf), "momentum": (0.0, 1.0), "weight_decay": (0.0, math.inf)},
    "adagrad": {
        "lr": (0.0, math.inf),
        "lr_decay": (0.0, math.inf),
        "initial_accumulator_value": (0.0, math.inf),
        "eps": (0.0, math.inf),
    },
    "adam": {"lr": (0.0, math.inf), "beta1": (0.0, 1.0), "beta2": (0.0, 1.0), "eps": (0.0, math.inf)},
}
"""Allowlist of row-wise optimizers and the closed ranges of their numeric arguments (momentum and
betas below 1): sgd (with momentum), adagrad, adam (lazy, as torch.optim.SparseAdam)."""

ROW_HYPERPARAMETERS: dict[str, frozenset[str]] = {
    "sgd": frozenset({"lr", "momentum", "weight_decay"}),
    "adagrad": frozenset({"lr", "lr_decay", "eps"}),
    "adam": frozenset({"lr", "beta1", "beta2", "eps"}),
}
"""The row optimizer arguments a PushRows may set for its step (an lr scheduler's values); they stay
in force after it. ``initial_accumulator_value`` only shapes fresh state, so it is not among them."""

DENSE_TO_ROW = {"sgd": "sgd", "adagrad": "adagrad", "adam": "adam", "adamw": "adam", "sparse_adam": "adam"}
"""The row optimizer a model's tables get by default from its dense optimizer's name."""

SHARD_SALT = 0x5DEECE66D
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 of every element of ``x`` (uint64 array, wrapping arithmetic); same shape."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def shard_of(ids: torch.Tensor, num_shards: int) -> torch.Tensor:
    """The shard of each row id.

    Args:
        ids: int64 tensor of row ids, any shape.
        num_shards: shards in the cluster (>= 1).

    Returns:
        int64 tensor of ``ids``' shape, values in ``[0, num_shards)``.
    """
    raw = ids.detach().cpu().contiguous().numpy().astype(np.int64, copy=False).view(np.uint64)
    mixed = mix64(raw ^ np.uint64(SHARD_SALT))
    return torch.from_numpy((mixed % np.uint64(num_shards)).astype(np.int64)).reshape(ids.shape)


def table_key(name: str, seed: int) -> int:
    """The 64-bit key of a table's initializer: the first 8 bytes of sha256(name, seed)."""
    digest = hashlib.sha256(f"{name}\0{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


INITIALIZERS = ("normal", "uniform")
"""The declared initializers of a table's rows: N(0, init_std**2), or U(init_low, init_high)."""


def initial_rows(
    name: str, seed: int, init_std: float, ids: torch.Tensor, dim: int, uniform: tuple[float, float] | None = None
) -> torch.Tensor:
    """The initial values of rows ``ids`` of a table: N(0, init_std**2) per element, from a
    counter-based generator (SplitMix64 of (table key ^ id) plus the element's counter; two
    uniforms per element, Box-Muller), or, with ``uniform=(low, high)``, ``low + (high - low) * u``
    of the element's first uniform ``u`` in [0, 1). A function of (name, seed, id, element) only:
    element j of a row does not depend on ``dim`` (``dim=1`` gives the first column).

    Args:
        ids: int64 tensor [n] of row ids.
        dim: elements per row.
        uniform: None (normal) or the bounds of a uniform initializer.

    Returns:
        float32 tensor [n, dim].
    """
    raw = ids.detach().cpu().contiguous().numpy().astype(np.int64, copy=False).view(np.uint64)
    base = mix64(raw ^ np.uint64(table_key(name, seed)))[:, None]
    counter = np.arange(dim, dtype=np.uint64)[None, :] * np.uint64(2)
    scale = 1.0 / float(2**53)
    with np.errstate(over="ignore"):
        h1 = mix64(base + counter)
        if uniform is not None:
            low, high = uniform
            u = (h1 >> np.uint64(11)).astype(np.float64) * scale
            return torch.from_numpy((low + (high - low) * u).astype(np.float32))
        h2 = mix64(base + counter + np.uint64(1))
    u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 0.5) * scale
    u2 = (h2 >> np.uint64(11)).astype(np.float64) * scale
    z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)
    return torch.from_numpy((z * init_std).astype(np.float32))


@dataclass(frozen=True)
class RowOptimizerSpec:
    """A validated row-wise optimizer: ``name`` in :data:`ROW_OPTIMIZERS`, numeric ``kwargs``.

    Every argument is checked as a dense optimizer's (``ps_common.optimizer.check_hyperparameter_range``
    on float32 rows): finite, within its range above, at most float32's largest value (about 3.4e38),
    and so is ``lr * weight_decay``.

    Raises:
        InvalidRequestError: unknown name or argument, a value out of range, no ``lr``.
    """

    name: str
    kwargs: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        allowed = ROW_OPTIMIZERS.get(self.name)
        if allowed is None:
            raise InvalidRequestError(
                f"Unknown row optimizer {self.name!r} for an embedding table; expected one of "
                f"{', '.join(sorted(ROW_OPTIMIZERS))}."
            )
        for k, v in self.kwargs.items():
            if k not in allowed:
                raise InvalidRequestError(
                    f"Row optimizer {self.name!r} takes no argument {k!r}; allowed: {', '.join(sorted(allowed))}."
                )
            low, high = allowed[k]
            upper_ok = v < high if high == 1.0 else v <= high
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= low and upper_ok):
                raise InvalidRequestError(
                    f"Row optimizer argument {k}={v!r} is out of range ({low} <= {k}"
                    f"{' < 1' if high == 1.0 else ''}, finite)."
                )
        if "lr" not in self.kwargs:
            raise InvalidRequestError(f"Row optimizer {self.name!r} needs a learning rate 'lr'.")
        check_hyperparameter_range(self.kwargs, [torch.float32])  # rows are float32: as a dense optimizer's

    def get(self, key: str, default: float) -> float:
        return float(self.kwargs.get(key, default))


@dataclass(frozen=True)
class TableSpec:
    """One embedding table, validated.

    Attributes:
        name: the table's name (the module's parameter name, e.g. ``"emb.weight"``).
        num_rows: ids are int64 in ``[0, num_rows)``, ``1 <= num_rows <= 2**63 - 1``.
        dim: elements per row, ``1 <= dim <= 65536``.
        seed, init_std: initial rows are N(0, init_std**2) (:func:`initial_rows`).
        initializer, init_low, init_high: ``"normal"`` (N(0, init_std**2), the default) or
            ``"uniform"``: rows U(init_low, init_high) (finite, ``init_low < init_high``; DLRM's
            U(-1/sqrt(rows), 1/sqrt(rows))). The bounds are 0 for ``"normal"``.
        optimizer: the row-wise optimizer the shards run.
        dtype: "float32" (the only one).
        admit_after: a row is stored only from its ``admit_after``-th push on (0 or 1: at its first;
            at most 255); before, pulls read its initial value and its gradients are dropped
            (frequency filtering, Monolith, arXiv:2209.07663 section 3.2). docs/tables.md.
        expire_after_rounds: evict rows not pushed for this many table versions (0: never).
        expire_after_seconds: evict rows not pushed for this many seconds (0: never).
        max_bytes: most bytes this table holds on one shard, rows and optimizer state, ids and index,
            capacity included (0: only the shard's ``--max-table-rows``/``--max-table-bytes``).
        on_full: ``"refuse"`` (TABLE_FULL beyond the bound, the default) or ``"evict_lru"`` (evict the
            least recently pushed rows; needs ``max_bytes``).

    Raises:
        InvalidRequestError: a field out of range.
    """

    name: str
    num_rows: int
    dim: int
    optimizer: RowOptimizerSpec
    seed: int = 0
    init_std: float = 1.0
    dtype: str = "float32"
    admit_after: int = 0
    expire_after_rounds: int = 0
    expire_after_seconds: float = 0.0
    max_bytes: int = 0
    on_full: str = "refuse"
    initializer: str = "normal"
    init_low: float = 0.0
    init_high: float = 0.0

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > MAX_NAME_CHARS:
            raise InvalidRequestError(f"A table name must have 1 to {MAX_NAME_CHARS} characters.")
        if not 1 <= self.num_rows <= MAX_ROWS:
            raise InvalidRequestError(f"Table {self.name!r}: num_rows must be in 1..2**63-1, got {self.num_rows}.")
        if not 1 <= self.dim <= MAX_DIM:
            raise InvalidRequestError(f"Table {self.name!r}: dim must be in 1..{MAX_DIM}, got {self.dim}.")
        if not 0 <= self.seed < 2**64:
            raise InvalidRequestError(f"Table {self.name!r}: seed must be in 0..2**64-1.")
        if not (math.isfinite(self.init_std) and self.init_std >= 0):
            raise InvalidRequestError(f"Table {self.name!r}: init_std must be a finite number >= 0.")
        if self.dtype != "float32":
            raise InvalidRequestError(f"Table {self.name!r}: rows must be float32, got {self.dtype}.")
        self._check_initializer()
        self._check_lifetime()

    def _check_initializer(self) -> None:
        """Refuse an unknown initializer or bounds that are not finite float32 ``low < high`` (InvalidRequestError)."""
        low, high, big = self.init_low, self.init_high, 3.0e38
        if self.initializer not in INITIALIZERS:
            raise InvalidRequestError(
                f"Table {self.name!r}: initializer must be one of {', '.join(INITIALIZERS)}, "
                f"got {self.initializer[:32]!r}."
            )
        if self.initializer == "normal" and (low, high) != (0.0, 0.0):
            raise InvalidRequestError(f"Table {self.name!r}: init_low/init_high apply to initializer='uniform' only.")
        finite = math.isfinite(low) and math.isfinite(high)
        if self.initializer == "uniform" and not (finite and -big < low < high < big):
            raise InvalidRequestError(
                f"Table {self.name!r}: a uniform initializer needs finite init_low < init_high, got {low}, {high}."
            )

    def _check_lifetime(self) -> None:
        """Refuse admission, expiry and bound settings out of range (InvalidRequestError)."""
        if not 0 <= self.admit_after <= MAX_ADMIT_AFTER:
            raise InvalidRequestError(
                f"Table {self.name!r}: admit_after must be in 0..{MAX_ADMIT_AFTER} (0: every row at its first "
                f"push), got {self.admit_after}."
            )
        if not 0 <= self.expire_after_rounds < 2**62:
            raise InvalidRequestError(
                f"Table {self.name!r}: expire_after_rounds must be >= 0 (0: never), got {self.expire_after_rounds}."
            )
        seconds = self.expire_after_seconds
        if not (math.isfinite(seconds) and seconds >= 0):
            raise InvalidRequestError(
                f"Table {self.name!r}: expire_after_seconds must be a finite number >= 0 (0: never), got {seconds}."
            )
        if not 0 <= self.max_bytes < 2**62:
            raise InvalidRequestError(f"Table {self.name!r}: max_bytes must be >= 0 (0: no bound of its own).")
        if self.on_full not in ON_FULL:
            raise InvalidRequestError(
                f"Table {self.name!r}: on_full must be one of {', '.join(ON_FULL)}, got {self.on_full[:32]!r}."
            )
        if self.on_full == "evict_lru" and self.max_bytes == 0:
            raise InvalidRequestError(
                f"Table {self.name!r}: on_full='evict_lru' evicts down to max_bytes; set max_bytes (bytes per shard)."
            )

    @property
    def admits(self) -> bool:
        """True when rows wait for ``admit_after`` pushes before they are stored."""
        return self.admit_after > 1

    @property
    def expires(self) -> bool:
        """True when untouched rows expire."""
        return self.expire_after_rounds > 0 or self.expire_after_seconds > 0

    @property
    def uniform(self) -> tuple[float, float] | None:
        """The uniform initializer's bounds, or None (normal)."""
        return (self.init_low, self.init_high) if self.initializer == "uniform" else None

    def initial(self, ids: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """:func:`initial_rows` of ``ids`` (int64 [n]) under this spec: float32 [n, dim or self.dim]."""
        return initial_rows(self.name, self.seed, self.init_std, ids, dim or self.dim, self.uniform)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (float32)."""
        return self.dim * 4


def max_rows_per_message(max_message_bytes: int, dim: int, overhead: int = 64 * 1024) -> int:
    """Most rows of ``dim`` float32 elements (with their 8-byte ids) one message of
    ``max_message_bytes`` carries, ``overhead`` bytes kept for framing."""
    return max(0, (max_message_bytes - overhead) // (8 + 4 * dim))
