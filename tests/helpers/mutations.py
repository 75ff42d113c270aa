"""Byte mutations for fuzzing (hypothesis strategies): a valid message's bytes with a few random edits."""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def mutated(draw: st.DrawFn, seed: bytes) -> bytes:
    """``seed`` with a few random edits (byte flips, a cut, an insertion, a repeated slice), or random bytes."""
    how = draw(st.sampled_from(["random", "flip", "cut", "insert", "repeat", "seed"]))
    if how == "random" or not seed:
        return draw(st.binary(max_size=200))
    data = bytearray(seed)
    if how == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
    elif how == "cut":
        i, j = sorted(draw(st.lists(st.integers(0, len(data)), min_size=2, max_size=2)))
        del data[i:j]
    elif how == "insert":
        i = draw(st.integers(0, len(data)))
        data[i:i] = draw(st.binary(min_size=1, max_size=12))
    elif how == "repeat":
        i, j = sorted(draw(st.lists(st.integers(0, len(data)), min_size=2, max_size=2)))
        data[j:j] = data[i:j]
    return bytes(data)
