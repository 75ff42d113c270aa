"""The --fault syntax of ps-launch."""

from __future__ import annotations

import pytest

from ps_launch.faults import Fault, parse_faults


def test_parse_and_trigger() -> None:
    faults = parse_faults("kill-worker:1@step=30; kill-shard:0@step=40,restart", shards=2, workers=2)
    assert faults == [Fault("worker", 1, 30), Fault("shard", 0, 40, restart=True)]
    assert [str(f) for f in faults] == ["kill-worker:1@step=30", "kill-shard:0@step=40,restart"]
    assert faults[0].due(rank=1, step=30) and not faults[0].due(rank=0, step=99) and not faults[0].due(1, 29)
    assert faults[1].due(rank=0, step=41) and not faults[1].due(rank=1, step=41)
    assert parse_faults("", 1, 1) == []


@pytest.mark.parametrize(
    ("text", "message"),
    [("kill-worker:1", "expected kill-worker"), ("kill-pod:0@step=1", "expected"), ("kill-worker:2@step=3", "only 2")],
)
def test_bad_specs_say_the_syntax(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_faults(text, shards=2, workers=2)
