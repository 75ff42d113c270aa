"""``charlm``: a small GPT-style character model (nanoGPT-like) on a text file, next byte from the last 128.

Model (defaults of :class:`GPTConfig`): vocabulary of the 256 byte values; token and learned position
embeddings of 128 dims; 4 pre-LayerNorm transformer blocks, each causal self-attention with 4 heads
(``torch.nn.functional.scaled_dot_product_attention``) and a 4x GELU MLP; a final LayerNorm and an
output head tied to the token embedding. 842,496 parameters in 52 tensors, 3.2 MiB of float32.
A training step of batch 8 x 128 chars takes 0.1-0.25 s on one CPU core, so run it with
``--batch-size 8``: a few hundred steps in about a minute.

Data: the corpus is read as bytes and cut into non-overlapping blocks of ``block_size + 1`` bytes
(input = first ``block_size``, target = the same shifted by one). Every 10th block is held out;
:meth:`CharLMWorkload.evaluate` scores at most ``eval_blocks`` of them (evenly spread) and reports
``loss`` (cross-entropy in nats per char), ``accuracy`` (next-char top-1) and ``bits_per_char``.
An untrained model scores about ``log(256) = 5.55`` nats.

Default corpus: the Python standard library's own source, so no download is needed: the ``.py``
files under ``sysconfig.get_paths()["stdlib"]`` in sorted path order, without test suites and
installed packages, concatenated up to 2 MB. It is the same on every run of one Python installation.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

DEFAULT_CORPUS_BYTES = 2_000_000
"""Size cap of the default corpus, in bytes."""

SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
"""Directories of the standard library left out of the default corpus."""

HELD_OUT_EVERY = 10
"""Every 10th block is held out."""


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of :class:`CharGPT` (vocabulary = the 256 byte values)."""

    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    vocab_size: int = 256
    tie_weights: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head}).")
        if min(self.block_size, self.n_layer, self.n_head, self.vocab_size) < 1:
            raise ValueError("block_size, n_layer, n_head and vocab_size must be >= 1.")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: float ``[batch, time, n_embd]`` -> same shape."""
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        hidden = 4 * cfg.n_embd
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, hidden), nn.GELU(), nn.Linear(hidden, cfg.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """GPT over bytes (Radford et al. 2019; layout and init of Karpathy's nanoGPT)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok.weight  # one tensor; named_parameters() lists it once, as tok.weight
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:  # residual projections scaled down with depth (GPT-2)
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("attn.proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx``: int64 ``[batch, time]`` bytes, ``time <= block_size`` -> float ``[batch, time, 256]`` logits."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"Sequence of {t} exceeds block_size {self.cfg.block_size}.")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class CharBlocks(Dataset):
    """Blocks of a byte corpus: item i is ``(data[s:s+T], data[s+1:s+T+1])`` as int64 ``[T]`` for the
    i-th start ``s`` of ``starts``."""

    def __init__(self, data: torch.Tensor, starts: torch.Tensor, block_size: int) -> None:
        self.data = data
        self.starts = starts
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        chunk = self.data[s : s + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def default_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> bytes:
    """The standard library's ``.py`` sources in sorted path order, concatenated, cut at ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        if SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        out += path.read_bytes()
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


class CharLMWorkload:
    """Next-char prediction with :class:`CharGPT` (see the module docstring for sizes and data).

    Args:
        corpus: a text file to train on; None or "" for the standard library's source.
        config: model sizes.
        max_corpus_bytes: bytes of the corpus used (the rest is ignored).
        eval_blocks: held-out blocks scored by :meth:`evaluate` (128 blocks = 16,384 chars).

    Raises:
        FileNotFoundError: ``corpus`` does not exist.
        ValueError: the corpus is too small for 20 blocks.
    """

    name = "charlm"

    def __init__(
        self,
        corpus: str | Path | None = None,
        *,
        config: GPTConfig | None = None,
        max_corpus_bytes: int = DEFAULT_CORPUS_BYTES,
        eval_blocks: int = 128,
    ) -> None:
        self.corpus = Path(corpus) if corpus else None
        self.config = config or GPTConfig()
        self.max_corpus_bytes = max_corpus_bytes
        self.eval_blocks = eval_blocks
        if self.corpus is not None and not self.corpus.is_file():
            raise FileNotFoundError(f"Corpus {str(self.corpus)!r} is not a file; pass a text file to --corpus.")

    def text(self) -> bytes:
        """The corpus bytes this workload trains on."""
        if self.corpus is None:
            return default_corpus(self.max_corpus_bytes)
        with open(self.corpus, "rb") as f:
            return f.read(self.max_corpus_bytes)

    def model(self) -> torch.nn.Module:
        return CharGPT(self.config)

    def datasets(self) -> tuple[Dataset, Dataset]:
        raw = self.text()
        t = self.config.block_size
        starts = torch.arange(0, max(0, len(raw) - t), t + 1)
        if len(starts) < 2 * HELD_OUT_EVERY:
            need = 2 * HELD_OUT_EVERY * (t + 1) + t
            raise ValueError(f"The corpus has {len(raw)} bytes; charlm needs at least {need} for block size {t}.")
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        held = (torch.arange(len(starts)) % HELD_OUT_EVERY) == HELD_OUT_EVERY - 1
        train, held_out = starts[~held], starts[held]
        if len(held_out) > self.eval_blocks:
            held_out = held_out[torch.linspace(0, len(held_out) - 1, self.eval_blocks).long()]
        return CharBlocks(data, train, t), CharBlocks(data, held_out, t)

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, held_out: Dataset, batch_size: int = 64) -> dict[str, float]:
        """Held-out ``loss`` (nats/char), ``accuracy`` (next-char top-1) and ``bits_per_char``."""
        assert isinstance(held_out, CharBlocks)
        total, correct, count = 0.0, 0, 0
        for i in range(0, len(held_out), batch_size):
            xs, ys = zip(*(held_out[j] for j in range(i, min(i + batch_size, len(held_out)))), strict=True)
            x, y = torch.stack(xs), torch.stack(ys)
            logits = model(x).reshape(-1, self.config.vocab_size)
            total += float(F.cross_entropy(logits, y.reshape(-1), reduction="sum"))
            correct += int((logits.argmax(1) == y.reshape(-1)).sum())
            count += y.numel()
        loss = total / max(1, count)
        return {"loss": loss, "accuracy": correct / max(1, count), "bits_per_char": loss / math.log(2)}
