"""A synthetic click log with a known ground truth: Zipf-distributed categorical ids, dense features, and
a hidden logistic model, so the best achievable held-out AUC is known (see ``docs/ctr.md``).

Impression ``i`` has ``D`` dense features ``x_i ~ N(0, I_D)`` and one id per categorical field ``f``.
Within field ``f`` the id's popularity rank ``r`` (0 = most frequent) is drawn from a Zipf law truncated to
the field's cardinality ``C_f``: ``P(r) = (r + 1)^-a_f / H(C_f, a_f)`` (Zipf 1949; the long-tailed id
frequencies of click logs, e.g. Criteo's). The id itself is ``mix_f(r)``, a fixed bijection of
``[0, 2^40)``, so ids are spread over a 2^40 range as hashed feature values are.

The click probability is ``p_i = sigmoid(z_i)`` with the hidden logit

    z_i = b + x_i . v + sum_f s_f * w_f(id_if) + t * sum_{(f, g) in PAIRS} <u_f(id_if), u_g(id_ig)> / sqrt(k)

where ``w_f(id)`` ~ N(0, 1) and ``u_f(id)`` ~ N(0, I_k) are pseudo-random functions of ``(seed, field, id)``
(a SplitMix64 hash, Steele et al. 2014, then Box-Muller), so no array of per-id weights is ever stored,
and ``y_i ~ Bernoulli(p_i)``. The ground-truth AUC is the AUC of ``p_i`` itself on the held-out set:
no model of the features can do better in expectation. Everything is a pure function of the seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

ID_BITS = 40
"""Ids live in ``[0, 2^ID_BITS)``."""

MAX_FIELDS = 63
"""Fields and latent slots share the 12 low bits of a hash key (:func:`hashed_normal`): at most 63 fields ..."""
MAX_LATENT_DIM = 62
"""... and 62 latent dimensions (slot 0 is the per-id weight)."""

_MASK40 = np.uint64((1 << ID_BITS) - 1)
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class ClickLogConfig:
    """The generator's parameters (defaults: the ``ctr`` workload's data, documented in ``docs/ctr.md``).

    Attributes:
        cardinalities: distinct ids per categorical field, ``C_f``.
        zipf_exponents: Zipf exponent ``a_f`` per field (> 0; 1.1-1.3 is typical of click logs).
        id_scales: ``s_f``, the standard deviation of field f's per-id logit term.
        pairs: field pairs ``(f, g)`` whose latent vectors interact in the logit.
        latent_dim: ``k``, length of the latent vectors ``u_f(id)``.
        interaction_scale: ``t``, the weight of the interaction term.
        dense_weights: ``v``, one weight per dense feature (``D = len(dense_weights)``).
        bias: ``b``, the logit's intercept (sets the click rate).
        seed: seeds the impressions (features, ids, clicks) and the hidden weights.
    """

    cardinalities: tuple[int, ...] = (100_000, 20_000, 5_000, 500, 200, 50)
    zipf_exponents: tuple[float, ...] = (1.2, 1.2, 1.1, 1.2, 1.3, 1.3)
    id_scales: tuple[float, ...] = (0.1, 0.15, 0.3, 0.5, 0.5, 0.5)
    pairs: tuple[tuple[int, int], ...] = ((3, 4), (4, 5), (3, 5))
    latent_dim: int = 4
    interaction_scale: float = 0.5
    dense_weights: tuple[float, ...] = (0.6, -0.5, 0.4, 0.3)
    bias: float = -1.3
    seed: int = 0

    def __post_init__(self) -> None:
        f = len(self.cardinalities)
        if f == 0 or len(self.zipf_exponents) != f or len(self.id_scales) != f:
            raise ValueError(
                f"cardinalities, zipf_exponents and id_scales need one entry per field; got {len(self.cardinalities)}, "
                f"{len(self.zipf_exponents)} and {len(self.id_scales)}."
            )
        if min(self.cardinalities) < 1 or max(self.cardinalities) > 1 << ID_BITS:
            raise ValueError(f"Every cardinality must be in 1..2^{ID_BITS}; got {self.cardinalities}.")
        if min(self.zipf_exponents) <= 0:
            raise ValueError(f"Zipf exponents must be > 0; got {self.zipf_exponents}.")
        if any(not (0 <= a < f and 0 <= b < f and a != b) for a, b in self.pairs):
            raise ValueError(f"Every pair must name two different fields in 0..{f - 1}; got {self.pairs}.")
        if f > MAX_FIELDS or not 1 <= self.latent_dim <= MAX_LATENT_DIM or not self.dense_weights:
            raise ValueError(
                f"At most {MAX_FIELDS} fields, latent_dim in 1..{MAX_LATENT_DIM} and at least one dense weight; got "
                f"{f} fields, latent_dim {self.latent_dim}, {len(self.dense_weights)} dense weights."
            )

    @property
    def num_fields(self) -> int:
        """``F``, the number of categorical fields."""
        return len(self.cardinalities)

    @property
    def num_dense(self) -> int:
        """``D``, the number of dense features."""
        return len(self.dense_weights)


@dataclass(frozen=True)
class ClickLog:
    """Impressions of the click log.

    Attributes:
        dense: float32 ``[n, D]``, the dense features.
        ids: int64 ``[n, F]``, one id in ``[0, 2^40)`` per categorical field.
        clicks: float32 ``[n]``, 0 or 1.
        probability: float64 ``[n]``, the hidden click probability ``p_i``.
    """

    dense: np.ndarray
    ids: np.ndarray
    clicks: np.ndarray
    probability: np.ndarray

    def __len__(self) -> int:
        return len(self.clicks)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer (Steele, Lea, Flood 2014), elementwise: uint64 -> uint64, wrapping."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x += np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def mix_ids(ranks: np.ndarray, fld: int) -> np.ndarray:
    """Field ``fld``'s fixed bijection of ``[0, 2^40)``: popularity rank -> id (int64 in, int64 out).

    Two rounds of (multiply by an odd constant, add, xor-shift), each invertible modulo 2^40, so distinct
    ranks get distinct ids and neighbouring ranks land far apart.
    """
    x = ranks.astype(np.uint64)
    salt = np.uint64((0x632BE59BD9B4E019 * (fld + 1)) & ((1 << ID_BITS) - 1))
    with np.errstate(over="ignore"):
        for mul in (0x9E3779B97F4A7C15 | 1, 0xD6E8FEB86659FD93 | 1):
            x = (x * np.uint64(mul & _MASK64) + salt) & _MASK40
            x = x ^ (x >> np.uint64(ID_BITS // 2))
    return x.astype(np.int64)


def vocabulary(cfg: ClickLogConfig, fld: int) -> np.ndarray:
    """Every id field ``fld`` can take, sorted: int64 ``[C_f]`` (the field's catalogue, as an ad or item table)."""
    return np.sort(mix_ids(np.arange(cfg.cardinalities[fld], dtype=np.int64), fld))


def hashed_normal(ids: np.ndarray, fld: int, slot: int, seed: int = 0) -> np.ndarray:
    """A standard normal that is a fixed function of ``(seed, fld, slot, id)``: float64, shaped like ``ids``.

    Two SplitMix64 hashes give two uniforms in (0, 1); Box-Muller (1958) turns them into one N(0, 1).
    """
    key = (ids.astype(np.uint64) << np.uint64(12)) ^ np.uint64(((fld + 1) << 6) ^ slot)
    h1 = splitmix64(key ^ np.uint64((seed * 0xD1B54A32D192ED03) & _MASK64))
    h2 = splitmix64(h1 ^ np.uint64(0xA0761D6478BD642F))
    u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    u2 = (h2 >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)


@lru_cache(maxsize=32)
def zipf_cdf(cardinality: int, exponent: float) -> np.ndarray:
    """float64 ``[cardinality]``: the CDF of the Zipf law truncated to ranks ``0..cardinality-1``."""
    weights = np.arange(1, cardinality + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    cdf.flags.writeable = False  # cached: shared by every caller
    return cdf


def true_logit(cfg: ClickLogConfig, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The hidden logit ``z`` (module docstring): float64 ``[n]`` from ``dense`` ``[n, D]`` and ``ids`` ``[n, F]``."""
    z = cfg.bias + dense.astype(np.float64) @ np.asarray(cfg.dense_weights, dtype=np.float64)
    for f in range(cfg.num_fields):
        z += cfg.id_scales[f] * hashed_normal(ids[:, f], f, 0, cfg.seed)
    latent = {
        f: np.stack([hashed_normal(ids[:, f], f, 1 + j, cfg.seed) for j in range(cfg.latent_dim)], axis=1)
        for f in sorted({f for pair in cfg.pairs for f in pair})
    }
    for f, g in cfg.pairs:
        z += cfg.interaction_scale * (latent[f] * latent[g]).sum(axis=1) / math.sqrt(cfg.latent_dim)
    return z


def generate(cfg: ClickLogConfig, n: int, stream: int) -> ClickLog:
    """``n`` impressions of stream ``stream`` (0 = training, 1 = held out: disjoint random streams).

    Deterministic: a numpy ``PCG64`` generator seeded with ``(cfg.seed, stream)``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}.")
    rng = np.random.Generator(np.random.PCG64([cfg.seed, stream]))
    dense = rng.standard_normal((n, cfg.num_dense)).astype(np.float32)  # the logit sees the features stored
    ids = np.empty((n, cfg.num_fields), dtype=np.int64)
    for f, (card, a) in enumerate(zip(cfg.cardinalities, cfg.zipf_exponents, strict=True)):
        cdf = zipf_cdf(card, a)
        ranks = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), card - 1)
        ids[:, f] = mix_ids(ranks, f)
    probability = 1.0 / (1.0 + np.exp(-true_logit(cfg, dense, ids)))
    clicks = (rng.random(n) < probability).astype(np.float32)
    return ClickLog(dense, ids, clicks, probability)
