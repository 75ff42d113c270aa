"""The environment contract of a user's training script (ps_worker.env): its errors name the variable."""

from __future__ import annotations

import pytest

from ps_common.flags import env_name
from ps_worker.env import CONTRACT, EnvError, init_from_env, rank_and_workers, read_env, single_process
from ps_worker.workloads.flags import worker_parser

GOOD = {"PS_SERVERS": "127.0.0.1:50051,127.0.0.1:50052", "PS_RANK": "1", "PS_NUM_WORKERS": "2"}


def test_the_three_required_variables_are_enough() -> None:
    s = read_env(GOOD)
    assert s.servers == ("127.0.0.1:50051", "127.0.0.1:50052") and s.rank == 1 and s.num_workers == 2
    assert (s.steps, s.batch_size, s.optimizer, s.lr, s.momentum, s.seed) == (300, 32, "sgd", 0.1, 0.9, 0)
    assert (s.token, s.wire_dtype, s.topk, s.timeout, s.incarnation) == ("", "native", 0.0, 60.0, None)
    assert s.optimizer_spec() == {"name": "sgd", "lr": 0.1, "momentum": 0.9}


@pytest.mark.parametrize("missing", ["PS_SERVERS", "PS_RANK", "PS_NUM_WORKERS"])
def test_a_missing_required_variable_is_named_with_what_to_set(missing: str) -> None:
    env = {k: v for k, v in GOOD.items() if k != missing}
    with pytest.raises(EnvError, match=rf"^{missing} is not set: set it to .*ps-launch, the compose file"):
        read_env(env)
    with pytest.raises(EnvError, match=rf"^{missing} is not set"):
        read_env({**env, missing: "  "})


@pytest.mark.parametrize(
    ("more", "message"),
    [
        ({"PS_RANK": "one"}, "PS_RANK='one' is not an integer; set PS_RANK to an integer."),
        ({"PS_RANK": "2"}, "PS_RANK=2 is outside 0..1 (PS_NUM_WORKERS=2)"),
        ({"PS_RANK": "-1"}, "PS_RANK='-1' must be >= 0."),
        ({"PS_NUM_WORKERS": "0", "PS_RANK": "0"}, "PS_NUM_WORKERS='0' must be >= 1."),
        ({"PS_SERVERS": "ps-0"}, "PS_SERVERS: Shard address 'ps-0' has no port"),
        ({"PS_WIRE_DTYPE": "int8"}, "PS_WIRE_DTYPE='int8' is invalid; choose from native, bfloat16, float16."),
        ({"PS_TOPK": "2"}, "PS_TOPK=2 is not in [0, 1]."),
        ({"PS_LR": "nan"}, "PS_LR='nan' must be >= 0."),
        ({"PS_STEPS": "many"}, "PS_STEPS='many' is not an integer"),
        ({"PS_OPTIMIZER": "lion"}, "PS_OPTIMIZER='lion' is invalid; choose from sgd"),
        ({"PS_TLS_CERT": "c.pem"}, "PS_TLS_CERT and PS_TLS_KEY go together"),
        ({"PS_TLS_CERT": "c.pem", "PS_TLS_KEY": "k.pem"}, "PS_TLS_CERT needs PS_TLS_CA"),
        ({"PS_TOKEN": "a", "PS_TOKEN_FILE": "/x"}, "Give PS_TOKEN or PS_TOKEN_FILE, not both."),
        ({"PS_TOKEN_FILE": "/nonexistent/token"}, "PS_TOKEN_FILE '/nonexistent/token' cannot be read"),
    ],
)
def test_an_invalid_value_is_named_with_its_value(more: dict[str, str], message: str) -> None:
    with pytest.raises(EnvError) as err:
        read_env({**GOOD, **more})
    assert message in str(err.value)


def test_token_file_and_every_optional_variable(tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    s = read_env(
        {
            **GOOD,
            "PS_TOKEN_FILE": str(token),
            "PS_WIRE_DTYPE": "bfloat16",
            "PS_TOPK": "0.01",
            "PS_TIMEOUT": "5",
            "PS_INCARNATION": "7",
            "PS_STEPS": "40",
            "PS_OPTIMIZER": "adamw",
            "PS_LR": "0.003",
        }
    )
    assert (s.token, s.wire_dtype, s.topk, s.timeout, s.incarnation, s.steps) == ("s3cret", "bfloat16", 0.01, 5, 7, 40)
    assert s.optimizer_spec() == {"name": "adamw", "lr": 0.003}


def test_the_contract_uses_ps_worker_s_own_twins() -> None:
    """A script and ps-worker run from the same environment: every variable is a ps-worker twin."""
    twins = {env for _, env, _ in worker_parser({}).twins}
    assert {v.name for v in CONTRACT} <= twins
    assert all(v.name == env_name("--" + v.name[3:].lower().replace("_", "-")) for v in CONTRACT)


class FakeClient:
    def __init__(self, servers, rank, num_workers, **kwargs) -> None:  # noqa: ANN001
        self.args = (servers, rank, num_workers, kwargs)
        self.inits: list[tuple[object, dict]] = []
        self.closed = False

    def init(self, model, optimizer) -> None:  # noqa: ANN001
        self.inits.append((model, optimizer))

    def close(self) -> None:
        self.closed = True


def test_init_from_env_builds_and_joins_a_client_overrides_win() -> None:
    client = init_from_env("model", environ={**GOOD, "PS_WIRE_DTYPE": "float16"}, client_class=FakeClient, timeout=3.0)
    servers, rank, workers, kwargs = client.args
    assert servers == ["127.0.0.1:50051", "127.0.0.1:50052"] and (rank, workers) == (1, 2)
    assert kwargs["wire_dtype"] == "float16" and kwargs["timeout"] == 3.0 and kwargs["token"] is None
    assert client.inits == [("model", {"name": "sgd", "lr": 0.1, "momentum": 0.9})]
    bare = init_from_env(environ=GOOD, client_class=FakeClient, rank=0)
    assert bare.args[1] == 0 and bare.inits == []


def test_psclient_from_env_reads_the_environment(monkeypatch) -> None:
    from ps_worker import PSClient

    monkeypatch.delenv("PS_SERVERS", raising=False)
    monkeypatch.setenv("PS_NUM_WORKERS", "2")  # a job of two workers: no single-process fallback
    with pytest.raises(EnvError, match="PS_SERVERS is not set"):
        PSClient.from_env()
    for k, v in GOOD.items():
        monkeypatch.setenv(k, v)
    client = PSClient.from_env()
    try:
        assert client.rank == 1 and client.num_workers == 2 and client.servers == list(GOOD["PS_SERVERS"].split(","))
    finally:
        client.close()


def test_the_readme_documents_every_variable_and_its_script_compiles() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Your own training script\n", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| `PS_")]
    assert {v.name for v in CONTRACT} == {
        name for line in table for name in line.split("|")[1].strip(" `").split("`, `")
    }
    script = section.split("```python\n", 1)[1].split("```", 1)[0]
    compile(script, "README.md", "exec")
    assert "PSClient.from_env(model)" in script


def test_the_contract_s_choices_are_the_allowlists_the_client_and_shards_use() -> None:
    """PS_OPTIMIZER and PS_WIRE_DTYPE accept exactly what ps_common's allowlist and the client take."""
    from ps_common.optimizer import OPTIMIZERS as SERVER_OPTIMIZERS
    from ps_worker import env
    from ps_worker.transport.encoding import WIRE_DTYPES as CLIENT_WIRE_DTYPES

    assert set(env.OPTIMIZERS) == set(SERVER_OPTIMIZERS)
    assert set(env.WIRE_DTYPES) - {"native"} == set(CLIENT_WIRE_DTYPES) - {"float32"}


SERVERS = {"PS_SERVERS": GOOD["PS_SERVERS"]}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),  # torchrun's alone
        ({"PS_RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),  # one of each
        ({"RANK": "0", "PS_NUM_WORKERS": "2"}, (0, 2)),
        ({"PS_RANK": "1", "PS_NUM_WORKERS": "2", "RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),  # agree
    ],
)
def test_torchrun_s_rank_and_world_size_stand_in_for_the_ps_twins(env: dict, expected: tuple) -> None:
    assert rank_and_workers(env) == expected
    s = read_env({**SERVERS, **env})
    assert (s.rank, s.num_workers) == expected


def test_the_ps_variables_win_over_torchrun_s_with_a_warning(caplog) -> None:
    env = {**SERVERS, "PS_RANK": "1", "PS_NUM_WORKERS": "3", "RANK": "2", "WORLD_SIZE": "3"}
    with caplog.at_level("WARNING", logger="ps_worker.env"):
        s = read_env(env)
    assert (s.rank, s.num_workers) == (1, 3)
    assert ["PS_RANK=1 and RANK=2 disagree; using PS_RANK=1"] == [r.getMessage() for r in caplog.records]
    caplog.clear()
    with caplog.at_level("WARNING", logger="ps_worker.env"):
        read_env({**SERVERS, "PS_RANK": "1", "PS_NUM_WORKERS": "3", "RANK": "1", "WORLD_SIZE": "3"})
    assert not caplog.records  # agreeing twins say nothing


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"WORLD_SIZE": "2"},
            "PS_RANK is not set: set it to this worker's rank, 0..PS_NUM_WORKERS-1 (or torchrun's RANK)",
        ),
        (
            {"RANK": "0"},
            "PS_NUM_WORKERS is not set: set it to number of worker ranks of the job (or torchrun's WORLD_SIZE)",
        ),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer; set RANK to an integer."),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "PS_RANK=2 is outside 0..1 (PS_NUM_WORKERS=2); give each worker"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be >= 1."),
        ({}, "PS_RANK is not set"),
    ],
)
def test_a_half_set_or_invalid_rank_is_named(env: dict, message: str) -> None:
    with pytest.raises(EnvError) as err:
        read_env({**SERVERS, **env})
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("env", "alone"),
    [
        ({}, True),  # python train.py on a laptop
        ({"RANK": "0", "WORLD_SIZE": "1"}, True),  # torchrun --nproc-per-node 1
        ({"PS_RANK": "0", "PS_NUM_WORKERS": "1"}, True),
        ({"RANK": "0", "WORLD_SIZE": "2"}, False),  # a job of two workers needs its shards named
        ({"PS_NUM_WORKERS": "2", "PS_RANK": "1"}, False),
        ({"PS_SERVERS": "127.0.0.1:1"}, False),  # a cluster is named
        ({"RANK": "0"}, False),  # half set: read_env names what is missing
    ],
)
def test_a_single_process_job_is_one_with_no_servers_and_no_other_worker(env: dict, alone: bool) -> None:
    assert single_process(env) is alone


def test_from_env_of_a_job_of_two_without_servers_still_fails() -> None:
    """No shard starts (this test may open no socket): the job names two workers and no shards."""
    with pytest.raises(EnvError, match="^PS_SERVERS is not set"):
        init_from_env(environ={"RANK": "0", "WORLD_SIZE": "2"}, client_class=FakeClient)
