"""The table of mode parameters reaches every place: flags, config, UpdateConfig, ps-admin set, the
settings lines and ps-launch's forwarding."""

from __future__ import annotations

import dataclasses
import re

import pytest

from ps_admin.cli import SET_FLAGS, admin_parser, update_request
from ps_admin.view import settings_text, status_json
from ps_common import modes
from ps_common.errors import InvalidRequestError
from ps_common.modes import PARAMETERS, UPDATABLE, ModeSettings
from ps_launch.cli import launch_parser
from ps_proto.v1 import ps_pb2
from ps_server.config import ServerConfig, config_from_args, server_parser

BASE = ["--shard-index", "0", "--num-shards", "1", "--num-workers", "4"]

SAMPLES = {
    "sync_quorum": ("2", 2),
    "round_timeout": ("2.5", 2.5),
    "max_staleness": ("3", 3),
    "staleness_lr": ("inverse", "inverse"),
    "staleness": ("5", 5),
    "moving_rate": ("0.5", 0.5),
    "communication_period": ("7", 7),
    "easgd_sync": (None, True),
    "outer_optimizer": ('{"name": "sgd", "lr": 1.0}', '{"name": "sgd", "lr": 1.0}'),
    "fragments": ("2", 2),
}
"""A value other than the default of every parameter: (text on the command line, parsed)."""

FLAGS = {p.name: p.flag for p in PARAMETERS}


def argv_of(names: list[str] | tuple[str, ...]) -> list[str]:
    argv: list[str] = []
    for name in names:
        text, _ = SAMPLES[name]
        argv += [FLAGS[name]] + ([] if text is None else [text])
    return argv


def test_every_parameter_has_a_sample_and_one_name_everywhere() -> None:
    names = [p.name for p in PARAMETERS]
    assert names == list(SAMPLES)
    assert len({p.flag for p in PARAMETERS}) == len({p.field for p in PARAMETERS}) == len(names)
    for p in PARAMETERS:
        assert p.flag == "--" + p.name.replace("_", "-")  # argparse's dest of the flag is the name
        assert set(p.modes) <= set(modes.MODES) and p.modes


def test_mode_settings_and_server_config_hold_every_parameter_with_its_default() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(ModeSettings)}
    assert list(fields)[2:] == [p.name for p in PARAMETERS]
    server = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    for p in PARAMETERS:
        assert fields[p.name] == server[p.name] == p.default, p.name


def test_server_and_launch_flags_come_from_the_table() -> None:
    for parser in (server_parser({}), launch_parser({})):
        twins = {flag: (env, text) for flag, env, text in parser.twins}
        defaults = vars(parser.parse_args(BASE if parser.prog == "ps-server" else ["digits"]))
        for p in PARAMETERS:
            assert twins[p.flag] == ("PS_" + p.name.upper(), p.help), (parser.prog, p.flag)
            assert defaults[p.name] == p.default


def test_config_from_flags_carries_every_parameter_into_the_mode_settings() -> None:
    config, _ = config_from_args([*BASE, "--mode", "easgd", *argv_of(list(SAMPLES))], environ={})
    settings = config.mode_settings()
    for p in PARAMETERS:
        assert getattr(config, p.name) == getattr(settings, p.name) == SAMPLES[p.name][1], p.name


def test_each_flag_twin_reaches_the_config() -> None:
    for p in PARAMETERS:
        text, value = SAMPLES[p.name]
        env = {"PS_" + p.name.upper(): "1" if text is None else text}
        config, _ = config_from_args(BASE, environ=env)
        assert getattr(config, p.name) == value, p.name


def test_cluster_config_has_a_field_for_every_parameter_and_the_moving_rate_in_force() -> None:
    fields = modes.config_fields(ModeSettings("easgd", num_workers=4))
    assert list(fields) == [p.field for p in PARAMETERS]
    config = ps_pb2.ClusterConfig(**fields)
    assert config.moving_rate == pytest.approx(0.9 / 4)
    others = {"mode", "num_workers", "lease_timeout_seconds", "learning_rate"}
    assert set(ps_pb2.ClusterConfig.DESCRIPTOR.fields_by_name) == others | set(fields)


def test_update_config_changes_exactly_the_updatable_parameters() -> None:
    request_fields = set(ps_pb2.UpdateConfigRequest.DESCRIPTOR.fields_by_name) - {"learning_rate", "mode", "at_version"}
    assert {p.field for p in UPDATABLE} == request_fields
    # workers' loop depends on easgd_sync; rank 0's Init sets the outer optimizer
    assert [p.name for p in PARAMETERS if not p.updatable] == ["easgd_sync", "outer_optimizer"]
    assert modes.changes_from_request(ps_pb2.UpdateConfigRequest()) == {}
    for p in UPDATABLE:
        value = "" if p.name == "staleness_lr" else SAMPLES[p.name][1]
        request = ps_pb2.UpdateConfigRequest(**{p.field: value})
        assert modes.changes_from_request(request) == {p.name: value}
        ModeSettings("sync", num_workers=4).updated(**modes.changes_from_request(request))


def test_admin_set_has_a_flag_per_updatable_parameter_that_fills_its_field() -> None:
    parser = admin_parser({})
    set_twins = {flag: env for flag, env, _ in parser.twins if env.startswith("PS_SET_")}
    for p in UPDATABLE:
        assert p.flag in SET_FLAGS.split(", ")
        assert set_twins[p.flag] == "PS_SET_" + p.name.upper()
        args = parser.parse_args(["--servers", "h:1", "set", *argv_of([p.name])])
        request = update_request(args)
        assert request.HasField(p.field) and getattr(request, p.field) == SAMPLES[p.name][1], p.name
        assert modes.changes_from_request(request) == {p.name: SAMPLES[p.name][1]}
    args = parser.parse_args(["--servers", "h:1", "set", "--staleness-lr", "none"])
    assert update_request(args).HasField("staleness_lr") and update_request(args).staleness_lr == ""


def test_settings_lines_and_json_show_every_parameter_of_the_mode() -> None:
    for mode in modes.MODES:
        params = modes.of_mode(mode)
        assert params
        settings = ModeSettings(mode, num_workers=4, **{p.name: SAMPLES[p.name][1] for p in params})
        config = ps_pb2.ClusterConfig(mode=ps_pb2.Mode.Value(f"MODE_{mode.upper()}"), num_workers=4)
        config.MergeFrom(ps_pb2.ClusterConfig(**modes.config_fields(settings)))
        text = settings_text(config)
        for p in params:
            assert p.show(SAMPLES[p.name][1], 4) in text, (mode, p.name)
        assert list(modes.parameters_json(config, mode)) == [p.field for p in params]
    assert {p for mode in modes.MODES for p in modes.of_mode(mode)} == set(PARAMETERS)
    assert status_json([])["shards"] == []


def test_the_settings_lines_read_as_before() -> None:
    config = ps_pb2.ClusterConfig(mode=ps_pb2.MODE_SYNC, num_workers=4, learning_rate=0.05)
    assert settings_text(config) == "lr 0.05, sync quorum all, round timeout off"
    config = ps_pb2.ClusterConfig(mode=ps_pb2.MODE_EASGD, num_workers=4, moving_rate=0.225, communication_period=10)
    assert settings_text(config) == "lr -, easgd moving rate 0.225, period 10 (async)"
    config.easgd_sync = True
    assert modes.parameters_text(config, "easgd") == "moving rate 0.225, period 10 (rounds)"
    assert modes.parameters_text(config, "") == "?"


def test_launch_forwards_every_parameter_to_the_server_as_given() -> None:
    launch = launch_parser({})
    args = launch.parse_args(["--mode", "easgd", *argv_of(list(SAMPLES)), "digits"])
    forwarded, _ = config_from_args([*BASE, "--mode", "easgd", *modes.forward_flags(args)], environ={})
    for p in PARAMETERS:
        assert getattr(forwarded, p.name) == SAMPLES[p.name][1], p.name
    defaults = modes.forward_flags(launch.parse_args(["digits"]))
    assert "--moving-rate" not in defaults and "--easgd-sync" not in defaults  # left to the server's defaults
    assert defaults[defaults.index("--staleness-lr") + 1] == ""
    config, _ = config_from_args([*BASE, *defaults], environ={})
    assert modes.settings_of(config) == {p.name: p.default for p in PARAMETERS}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sync_quorum": 5}, "--sync-quorum must be in 0..4 (0 = every live rank), got 5."),
        ({"round_timeout": float("nan")}, "--round-timeout must be >= 0 seconds, got nan."),
        ({"max_staleness": -2}, "--max-staleness must be >= 0 (or -1 for no bound), got -2."),
        ({"staleness_lr": "sqrt"}, "--staleness-lr must be 'inverse' or empty, got 'sqrt'."),
        ({"staleness": 2**32 - 1}, "--staleness must be in 0..2147483647 clocks, got 4294967295 (-1 sent as an"),
        ({"moving_rate": 1.5}, "--moving-rate must be in (0, 1], got 1.5."),
        ({"communication_period": 0}, "--communication-period must be in 1..2147483647 steps, got 0."),
    ],
)
def test_each_rule_refuses_in_a_full_sentence(changes, message) -> None:
    with pytest.raises(InvalidRequestError) as err:
        ModeSettings("sync", num_workers=4, **changes)
    assert str(err.value).startswith(message)


def test_uint32_parses_the_range_of_a_uint32_field() -> None:
    assert modes.uint32("4294967295") == 2**32 - 1
    with pytest.raises(Exception, match="out of range"):
        modes.uint32("-1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("sgd", "must be a JSON object naming one of sgd"),
        ('{"lr": 0.7}', "must be a JSON object naming one of"),
        ('{"name": "lbfgs", "lr": 1}', "must be a JSON object naming one of"),
        ('{"name": "sgd"}', "sgd needs an lr"),
        ('{"name": "sgd", "lr": 0.7, "betas": 1}', "sgd has no argument 'betas'"),
        ('{"name": "sgd", "lr": "fast"}', """sgd takes lr as a finite number >= 0, not '"fast"'"""),
        ('{"name": "sgd", "lr": NaN}', "sgd takes lr as a finite number >= 0, not 'NaN'"),
        ('{"name": "sgd", "lr": Infinity}', "sgd takes lr as a finite number >= 0, not 'Infinity'"),
        ('{"name": "sgd", "lr": -0.5}', "sgd takes lr as a finite number >= 0, not '-0.5'"),
        ('{"name": "sgd", "lr": true}', "sgd takes lr as a finite number >= 0, not 'true'"),  # no number
        ('{"name": "sgd", "lr": 1, "nesterov": "yes"}', """sgd takes nesterov true or false, not '"yes"'"""),
        ('{"name": "adam", "lr": 0.1, "beta1": 1.0}', "adam takes beta1 in [0, 1) (torch.optim.Adam refuses 1.0)"),
        ("[" * 100_000 + "]" * 100_000, "must be a JSON object naming one of"),  # deeper than the parser goes
    ],
)
def test_a_bad_outer_optimizer_is_refused_in_a_full_sentence(text: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        ModeSettings("diloco", num_workers=2, outer_optimizer=text)
    assert modes.outer_optimizer_json(modes.DILOCO_OUTER_OPTIMIZER)["nesterov"] is True
    assert ModeSettings("diloco", num_workers=2, outer_optimizer="").outer_optimizer == modes.DILOCO_OUTER_OPTIMIZER


def test_easgd_and_diloco_cannot_be_switched_into_out_of_or_between_live() -> None:
    for old, new in (("sync", "diloco"), ("diloco", "async"), ("easgd", "diloco"), ("diloco", "easgd")):
        with pytest.raises(InvalidRequestError, match="restart the cluster"):
            ModeSettings(old, num_workers=2).updated(mode=new)
    assert ModeSettings("sync", num_workers=2).updated(mode="async").mode == "async"


@pytest.mark.parametrize("lr", ["NaN", "Infinity", "-1", "true"])
def test_ps_server_refuses_a_bad_outer_optimizer_at_its_start_in_one_line(lr: str, capsys) -> None:
    argv = [*BASE, "--mode", "diloco", "--outer-optimizer", f'{{"name": "sgd", "lr": {lr}}}']
    with pytest.raises(SystemExit) as exited:
        config_from_args(argv, environ={})
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and err[-1] == (
        f"ps-server: error: --outer-optimizer: sgd takes lr as a finite number >= 0, not '{lr}'."
    )
