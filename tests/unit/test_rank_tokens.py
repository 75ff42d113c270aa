"""Per-rank tokens (ps_server.service.rank_tokens): the file's format, malformed files refused at start,
the lookup, who may act as which rank, and the waiting calls' per-rank shares."""

from __future__ import annotations

import threading
from concurrent import futures

import pytest

from ps_common.errors import WrongRankError
from ps_server.config import config_from_args
from ps_server.service.rank_tokens import ADMIN, RANK, SHARED, Caller, RankTokens, check_caller, parse_rank_tokens
from ps_server.service.waiting_calls import Alarms, WaitingCalls, rank_share
from tests.unit.test_waiting_calls import Aborted, FakeContext

T0, T1 = "a" * 16 + "-rank0", "b" * 16 + "-rank1"
ARGS = ["--shard-index", "0", "--num-shards", "1", "--num-workers", "2"]


def test_the_file_names_one_token_per_rank_with_comments_and_blank_lines() -> None:
    tokens = parse_rank_tokens(f"# the job's ranks\n\n0 {T0}\n  1\t{T1}  \n")
    assert tokens.ranks == {0, 1} and len(tokens) == 2
    assert tokens.rank_of(T0) == 0 and tokens.rank_of(T1) == 1 and tokens.rank_of("c" * 20) is None
    assert tokens.token_of(1) == T1 and tokens.has(0) and not tokens.has(2)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "names no rank"),
        (f"0 {T0} extra\n", "line 1 is not 'RANK TOKEN'"),
        (f"zero {T0}\n", "line 1 is not 'RANK TOKEN'"),
        (f"-1 {T0}\n", "line 1 is not 'RANK TOKEN'"),
        (f"0 {T0}\n0 {T1}\n", "line 2 gives rank 0 a second token"),
        (f"0 {T0}\n1 {T0}\n", "the token of another rank"),
        ("0 short\n", "at least 16 characters"),
        (f"4096 {T0}\n", "outside 0..4095"),
    ],
)
def test_a_malformed_file_is_refused_naming_the_line_never_the_token(text: str, words: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_rank_tokens(text)
    assert words in str(err.value)
    assert T0 not in str(err.value) and T1 not in str(err.value)


def test_ps_server_reads_the_file_from_the_flag_or_its_twin_and_refuses_a_bad_one(tmp_path, capsys) -> None:
    good = tmp_path / "tokens"
    good.write_text(f"0 {T0}\n1 {T1}\n")
    config, _ = config_from_args(ARGS, environ={"PS_RANK_TOKENS_FILE": str(good)})
    assert config.rank_tokens is not None and config.rank_tokens.rank_of(T1) == 1
    assert config.rank_share == rank_share(config.waiting_calls, 2) == 6
    assert config.wait_threads == config.waiting_calls + 2 * 6 + 4
    assert T0 not in repr(config)
    bad = tmp_path / "bad"
    bad.write_text(f"0 {T0}\n1\n")
    for argv, environ in ((["--rank-tokens", str(bad)], {}), (["--rank-tokens", str(tmp_path / "none")], {})):
        with pytest.raises(SystemExit):
            config_from_args(ARGS + argv, environ=environ)
    err = capsys.readouterr().err
    assert "line 2 is not 'RANK TOKEN'" in err and "cannot be read" in err
    with pytest.raises(SystemExit):  # a rank's token may not be the shared one
        config_from_args(ARGS + ["--rank-tokens", str(good), "--token", T0], environ={})
    assert "the same token as --token" in capsys.readouterr().err


def test_a_caller_acts_only_as_the_ranks_its_token_allows() -> None:
    tokens = RankTokens({0: T0})

    class Ctx:
        def __init__(self, caller: Caller) -> None:
            self.caller = caller

    check_caller(Ctx(Caller(RANK, 0)), 0, "Push", tokens)
    check_caller(Ctx(Caller(SHARED)), 1, "Push", tokens)  # rank 1 has no token of its own
    check_caller(Ctx(Caller(ADMIN)), 0, "Push", tokens)
    check_caller(object(), 0, "Push", tokens)  # a data connection's call: its hello was checked
    for caller, rank, words in ((Caller(RANK, 0), 1, "token of rank 0"), (Caller(SHARED), 0, "shared worker token")):
        with pytest.raises(WrongRankError) as err:
            check_caller(Ctx(caller), rank, "Push", tokens)
        assert words in str(err.value) and "Nothing was changed" in str(err.value)


class RankContext(FakeContext):
    def __init__(self, caller: Caller | None) -> None:
        super().__init__()
        self.caller = caller


def test_each_rank_has_its_own_share_and_the_shared_token_keeps_the_global_cap() -> None:
    pool = futures.ThreadPoolExecutor(1)
    try:
        waiting = WaitingCalls(2, pool, rank_share=3)
        held = [RankContext(Caller(RANK, 1)) for _ in range(3)]
        for ctx in held:
            waiting._slot(ctx)
        with pytest.raises(Aborted):
            waiting._slot(RankContext(Caller(RANK, 1)))
        waiting._slot(RankContext(Caller(RANK, 0)))  # rank 0's share is its own
        waiting._slot(RankContext(Caller(SHARED)))
        waiting._slot(RankContext(None))
        with pytest.raises(Aborted) as err:
            waiting._slot(RankContext(Caller(SHARED)))
        assert "--max-waiting-calls 2 reached" in str(err.value)
        assert waiting.by_rank == {1: 3, 0: 1} and waiting.shared == 2 and waiting.open == 6
        held[0].end()
        assert waiting.by_rank[1] == 2 and waiting.open == 5
    finally:
        pool.shutdown(wait=False)


def test_alarms_ring_unless_disarmed() -> None:
    threads: list[threading.Thread] = []

    def start(run) -> None:
        thread = threading.Thread(target=run, daemon=True)
        threads.append(thread)
        thread.start()

    alarms = Alarms(start)
    rang = threading.Event()
    quiet = threading.Event()
    disarm = alarms.arm(0.05, quiet.set)
    alarms.arm(0.1, rang.set)
    disarm()
    assert rang.wait(5) and not quiet.is_set()
    alarms.close()
    threads[0].join(5)
    assert not threads[0].is_alive() and len(threads) == 1
