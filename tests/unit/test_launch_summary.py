"""ps-launch's summary from what each rank did; no processes."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest

from ps_launch.cli import RankRun, print_summary, summarize

ARGS = SimpleNamespace(workload="charlm", mode="sync", shards=2, workers=2, steps=300, batch_size=32)


def report(rank: int, first: int = 0, loss: float = 0.5, **more) -> dict:
    return {
        "rank": rank,
        "steps": 300,
        "first_step": first,
        "final_loss": loss,
        "accuracy": 0.5,
        "eval_loss": 1.2,
        "bits_per_char": 1.73,
        "wall_seconds": 5.0,
        "samples_per_second": 1.0,
        "pushed_bytes": 10,
        "pulled_bytes": 10,
        "version": 300,
        "params_sha256": "ab",
        **more,
    }


def test_a_restarted_rank_is_counted_by_what_it_ran() -> None:
    """Rank 1 killed at step 40, restarted, resumed at step 120: it ran 40 + 180 steps, not 300."""
    runs = {
        0: [RankRun(0, 300, report(0))],
        1: [RankRun(0, 40), RankRun(120, 300, report(1, first=120))],
    }
    s = summarize(ARGS, [report(0), report(1, first=120)], 10.0, [], runs=runs, train_seconds=4.0)
    assert s["steps_run_per_rank"] == [300, 220]
    assert s["ranks"][1] == {
        "rank": 1,
        "steps_run": 220,
        "samples": 220 * 32,
        "restarts": 1,
        "first_step": 0,
        "resumed_at": [120],
        "finished": True,
        "final_loss": 0.5,
    }
    assert s["steps_per_second"] == pytest.approx(520 / 4.0)
    assert s["samples_per_second"] == pytest.approx(s["steps_per_second"] * 32)  # consistent with the batch
    out = io.StringIO()
    print_summary(s, out)
    text = out.getvalue()
    assert "steps run per rank  [300, 220] (rank 1 restarted 1x, resumed at step 120)" in text
    assert "bits per char       1.730 (held out)" in text  # charlm's promised figure
    assert "staleness           0 (sync:" in text


def test_a_rank_that_trained_no_step_gives_null_not_nan() -> None:
    runs = {0: [RankRun(0, 300, report(0))], 1: [RankRun(300, 300, report(1, first=300, loss=None))]}
    s = summarize(ARGS, [report(0), report(1, first=300, loss=None)], 10.0, [], runs=runs, train_seconds=4.0)
    assert s["final_loss"] == 0.5 and s["ranks"][1]["steps_run"] == 0
    json.dumps(s, allow_nan=False)  # strict JSON


def test_staleness_unit_is_named_per_mode() -> None:
    s = summarize(SimpleNamespace(**{**vars(ARGS), "mode": "ssp"}), [report(0), report(1)], 1.0, [])
    out = io.StringIO()
    print_summary(s, out)
    assert "versions behind when applied; the bound s counts clocks" in out.getvalue()


def test_a_user_script_s_summary_counts_clocks_and_shows_what_each_rank_said() -> None:
    from ps_launch.summary import print_script_summary, summarize_script
    from ps_proto.v1 import ps_pb2

    args = SimpleNamespace(workload="train.py", mode="sync", shards=1, workers=2, steps=50, batch_size=32)
    status = ps_pb2.ShardStatus(version=50, received_bytes=2 * 1024 * 1024, sent_bytes=1024 * 1024)
    status.workers.extend(ps_pb2.WorkerStatus(rank=r, clock=50) for r in (0, 1))
    runs = {0: [RankRun(0, 50, {"rank": 0, "steps": 50})], 1: [RankRun(0, 12), RankRun(12, 50, {"steps": 50})]}
    done = {0: {"rank": 0, "steps": 50, "accuracy": 0.91}, 1: {"rank": 1, "steps": 50}}
    lines = {0: ["loading", "rank 0 done"], 1: []}
    s = summarize_script(args, done, 9.0, ["127.0.0.1:1"], [status], runs, lines, train_seconds=5.0)
    assert s["steps_run_per_rank"] == [50, 50] and s["ranks"][1]["restarts"] == 1
    assert s["accuracy"] == 0.91 and s["version"] == 50 and s["steps_per_second"] == pytest.approx(100 / 5.0)
    assert [r["last_line"] for r in s["ranks"]] == ["rank 0 done", ""]
    json.dumps(s, allow_nan=False)
    out = io.StringIO()
    print_script_summary(s, out)
    text = out.getvalue()
    assert text.startswith("grpc-ps run summary\n  script              train.py (sync, 1 shards x 2 workers)\n")
    assert "steps run per rank  [50, 50] (rank 1 restarted 1x, resumed at step 12)" in text
    assert "held-out accuracy   0.9100 (rank 0's report)" in text
    assert "rank 0 said         rank 0 done" in text and "rank 1 said         -" in text
    assert "pushed 2.0 MiB, pulled 1.0 MiB" in text


def _script_summary(mode: str, clocks: list[int], done: dict, period: int = 10) -> tuple[dict, str]:
    from ps_launch.summary import print_script_summary, summarize_script
    from ps_proto.v1 import ps_pb2

    args = SimpleNamespace(workload="train.py", mode=mode, shards=1, workers=len(clocks), steps=300, batch_size=32)
    status = ps_pb2.ShardStatus(version=max(clocks))
    status.config.communication_period = period
    status.workers.extend(ps_pb2.WorkerStatus(rank=r, clock=c) for r, c in enumerate(clocks))
    runs = {r: [RankRun(0, c, {"rank": r, "steps": c})] for r, c in enumerate(clocks)}
    lines = {r: [] for r in range(len(clocks))}
    s = summarize_script(args, done, 9.0, ["127.0.0.1:1"], [status], runs, lines, train_seconds=5.0)
    json.dumps(s, allow_nan=False)
    out = io.StringIO()
    print_script_summary(s, out)
    return s, out.getvalue()


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_a_script_s_summary_reports_the_steps_it_ran_not_ps_steps(mode: str) -> None:
    """A script that ran 320 and 168 steps under PS_STEPS=300: the summary says 320 and 168."""
    s, text = _script_summary(mode, [320, 168], {0: {"rank": 0, "steps": 320}, 1: {"rank": 1, "steps": 168}})
    assert s["steps_run_per_rank"] == [320, 168] and s["exchanges_per_rank"] is None
    assert "steps run per rank  [320, 168] (PS_STEPS was 300; the script ran its own count)" in text
    assert "(PS_STEPS)" not in text and "steps per worker" not in text
    _, text = _script_summary(mode, [300, 300], {})
    assert "steps run per rank  [300, 300]\n" in text  # what it was told: nothing more to say


def test_an_easgd_script_s_summary_shows_exchanges_and_local_steps_apart() -> None:
    """easgd: the shards count exchanges (clock); local steps are tau x exchanges at least, exact when
    the script reports them in its done line."""
    s, text = _script_summary("easgd", [10, 16], {}, period=10)
    assert s["exchanges_per_rank"] == [10, 16] and s["steps_run_per_rank"] == [100, 160]
    assert s["communication_period"] == 10 and s["steps_per_second"] == pytest.approx(260 / 5.0)
    assert "exchanges per rank    [10, 16] (every 10 local steps)" in text
    assert "local steps per rank  [100, 160] (at least exchanges x 10: later ones reach no shard; PS_STEPS" in text
    done = {0: {"rank": 0, "local_steps": 101}, 1: {"rank": 1, "local_steps": 168}}
    s, text = _script_summary("easgd", [10, 16], done, period=10)
    assert s["steps_run_per_rank"] == [101, 168] and s["exchanges_per_rank"] == [10, 16]
    assert "local steps per rank  [101, 168] (as the script reported; PS_STEPS was 300" in text
