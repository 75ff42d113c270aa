"""The charlm workload without a network: shapes, determinism, a split that holds out, learning."""

from __future__ import annotations

import math

import pytest
import torch

from ps_worker.workloads.charlm import CharBlocks, CharLMWorkload, GPTConfig, default_corpus
from ps_worker.workloads.registry import WORKLOADS, get_workload

TINY = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine two spinning threads run the loop 5-10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_registered_and_default_sizes() -> None:
    assert isinstance(get_workload("charlm"), CharLMWorkload)
    assert "charlm" in WORKLOADS
    torch.manual_seed(0)
    model = CharLMWorkload().model()
    named = list(model.named_parameters())
    assert sum(p.numel() for _, p in named) == 842_496  # the module docstring's count
    assert len(named) == 52
    assert "head.weight" not in dict(named)  # tied to tok.weight, listed once
    logits = model(torch.randint(0, 256, (2, 128)))
    assert logits.shape == (2, 128, 256) and logits.dtype == torch.float32


def test_causal_a_later_char_does_not_change_earlier_logits() -> None:
    torch.manual_seed(0)
    model = CharLMWorkload(config=TINY).model().eval()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10] = (y[0, 10] + 1) % 256
    assert torch.equal(model(x)[0, :10], model(y)[0, :10])
    assert not torch.equal(model(x)[0, 10:], model(y)[0, 10:])


def test_default_corpus_is_deterministic_and_capped() -> None:
    a, b = default_corpus(100_000), default_corpus(100_000)
    assert a == b and len(a) == 100_000
    assert b"def " in a and b"import " in a


def test_datasets_are_deterministic_and_disjoint(tmp_path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(bytes(range(256)) * 100)
    w = CharLMWorkload(corpus, config=TINY, eval_blocks=10_000)
    (train, held), (train2, held2) = w.datasets(), w.datasets()
    assert isinstance(train, CharBlocks) and isinstance(held, CharBlocks)
    assert torch.equal(train.starts, train2.starts) and torch.equal(held.starts, held2.starts)
    assert not set(train.starts.tolist()) & set(held.starts.tolist())
    assert len(held) == (len(train) + len(held)) // 10
    x, y = train[3]
    assert x.shape == y.shape == (32,) and x.dtype == torch.long
    assert torch.equal(x[1:], y[:-1])  # the target is the input shifted by one char


def test_eval_blocks_caps_the_held_out_set() -> None:
    _, held = CharLMWorkload(config=TINY, max_corpus_bytes=200_000, eval_blocks=7).datasets()
    assert len(held) == 7


def test_a_missing_or_tiny_corpus_is_refused(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="--corpus"):
        CharLMWorkload(tmp_path / "missing.txt")
    small = tmp_path / "small.txt"
    small.write_text("hello")
    with pytest.raises(ValueError, match="needs at least"):
        CharLMWorkload(small).datasets()
    with pytest.raises(ValueError, match="charlm only"):
        get_workload("digits", corpus=str(small))


def test_same_seed_same_model() -> None:
    w = CharLMWorkload(config=TINY)
    torch.manual_seed(3)
    a = w.model().state_dict()
    torch.manual_seed(3)
    b = w.model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_thirty_adamw_steps_lower_the_held_out_loss(one_thread) -> None:
    w = CharLMWorkload(config=TINY, max_corpus_bytes=300_000, eval_blocks=64)
    torch.manual_seed(0)
    model = w.model()
    train, held = w.datasets()
    before = w.evaluate(model.eval(), held)
    assert abs(before["loss"] - math.log(256)) < 0.2  # an untrained model guesses uniformly
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(train, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    model.train()
    for _, (x, y) in zip(range(30), loader, strict=False):
        opt.zero_grad()
        w.loss(model, x, y).backward()
        opt.step()
    after = w.evaluate(model.eval(), held)
    assert after["loss"] < before["loss"] - 1.0, (before, after)
    assert after["bits_per_char"] == pytest.approx(after["loss"] / math.log(2))
    assert after["accuracy"] > before["accuracy"]
