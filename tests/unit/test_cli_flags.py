"""Every ``miles-disagg`` (sub)command's parser is generated from its config dataclass(es)."""

from __future__ import annotations

import argparse

import pytest

from miles_disagg import cli
from miles_disagg.config.commands import LogFlags, config_from_args
from miles_disagg.config.fields import flag_specs
from miles_disagg.engines.builtin.config import ENGINE_DTYPES, EngineConfig


def command_configs() -> dict[tuple[str, ...], tuple[type, ...]]:
    """Each leaf of the command tree -> the config classes its options come from."""
    from miles_disagg.bench.async_train import AsyncBench
    from miles_disagg.bench.colocate import ColocateBench
    from miles_disagg.bench.delta import DeltaBench
    from miles_disagg.bench.agentic import AgenticBench
    from miles_disagg.bench.engine import EngineBench
    from miles_disagg.bench.hostile import HostileBench
    from miles_disagg.bench.lora import LoraBench
    from miles_disagg.bench.http_client import HttpBench
    from miles_disagg.bench.scale import ScaleBench
    from miles_disagg.bench.publish import PublishBench
    from miles_disagg.bench.store import StoreBench
    from miles_disagg.bench.sim.cli import SimEnginesCommand
    from miles_disagg.bench.service import ServiceBench
    from miles_disagg.engines.agent.cli import AgentCommand
    from miles_disagg.engines.relay.cli import RelayCommand
    from miles_disagg.fleet.members_cli import ACTIONS as ENGINES_ACTIONS
    from miles_disagg.loop.report_cli import ReportCommand
    from miles_disagg.models.cli import TinyCheckpointCommand
    from miles_disagg.weights.fp8_convert import ConvertFp8Command
    from miles_disagg.router.cli import RouterCommand
    from miles_disagg.service.cli import ROLES
    from miles_disagg.weights.cli import ACTIONS

    return {
        ("engine",): (EngineConfig, LogFlags),
        ("agent",): (AgentCommand,),
        ("relay",): (RelayCommand,),
        ("router",): (RouterCommand,),
        ("make-tiny-checkpoint",): (TinyCheckpointCommand,),
        ("convert-fp8",): (ConvertFp8Command,),
        ("report",): (ReportCommand,),
        **{("serve", role): (cls,) for role, cls in ROLES.items()},
        **{("weights", action): (cls,) for action, cls in ACTIONS.items()},
        ("bench", "delta"): (DeltaBench,),
        ("bench", "engine"): (EngineBench,),
        ("bench", "agentic"): (AgenticBench,),
        ("bench", "async"): (AsyncBench,),
        ("bench", "service"): (ServiceBench,),
        ("bench", "hostile"): (HostileBench,),
        ("bench", "colocate"): (ColocateBench,),
        ("bench", "http"): (HttpBench,),
        ("bench", "scale"): (ScaleBench,),
        ("bench", "publish"): (PublishBench,),
        ("bench", "store"): (StoreBench,),
        ("bench", "lora"): (LoraBench,),
        ("sim-engines",): (SimEnginesCommand,),
        **{("engines", action): (cls,) for action, cls in ENGINES_ACTIONS.items()},
    }


COMMANDS = command_configs()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    return dict(action.choices) if action else {}


def subparser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = cli.build_parser(list(path))
    for name in path:
        parser = _subparsers(parser)[name]
    return parser


def leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    children = _subparsers(parser)
    if not children:
        return {path}
    return set().union(*(leaves(child, path + (name,)) for name, child in children.items()))


def parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser(argv).parse_args(argv)


def test_every_command_has_a_config_class():
    found = set()
    for name in cli.SUBCOMMANDS:
        found |= leaves(subparser((name,)), (name,))
    assert found == set(COMMANDS)


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_options_are_exactly_the_config_fields(path):
    parser = subparser(path)
    specs = [spec for cls in COMMANDS[path] for spec in flag_specs(cls)]
    actions = {a.dest: a for a in parser._actions if not isinstance(a, argparse._HelpAction)}
    assert sorted(actions) == sorted(spec.dest for spec in specs)  # nothing hand-written beside the fields
    for spec in specs:
        action = actions[spec.dest]
        assert action.option_strings == ([] if spec.positional else [spec.flag] + (
            [spec.flag.replace("--", "--no-", 1)] if spec.base_type is bool else []))
        assert action.help.startswith(spec.help)
        assert spec.positional or action.required == spec.required  # a rest-of-line positional may be empty
        assert action.default is argparse.SUPPRESS  # the dataclass holds every default
        assert tuple(action.choices or ()) == tuple(spec.choices or ())


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_defaults_come_from_the_dataclass(path, tmp_path):
    (config_cls,) = COMMANDS[path][:1]
    required = {spec.dest: spec for spec in flag_specs(config_cls) if spec.required}
    values = {dest: ("http://127.0.0.1:1" if "url" in dest or dest == "gateway" else str(tmp_path / dest))
              for dest in required}
    if path == ("agent",):
        values["port"] = "30010"
    argv = [*path, *(arg for dest, value in values.items()
                     for arg in ((value,) if required[dest].positional else (required[dest].flag, value)))]
    config = config_from_args(config_cls, parse(argv))
    expected = config_cls(**{dest: required[dest].base_type(value) for dest, value in values.items()})
    assert config == expected


def test_engine_dtype_accepts_every_dtype_the_runtime_loads():
    assert "float16" in ENGINE_DTYPES
    for dtype in ENGINE_DTYPES:
        args = parse(["engine", "--model-path", "m", "--dtype", dtype, "--log-level", "info"])
        assert config_from_args(EngineConfig, args).dtype == dtype
        assert config_from_args(LogFlags, args).log_level == "info"


def test_lists_switches_and_positionals():
    from miles_disagg.bench.async_train import AsyncBench
    from miles_disagg.bench.service import ServiceBench
    from miles_disagg.router.cli import RouterCommand
    from miles_disagg.service.cli import ReplicaCommand

    router = config_from_args(RouterCommand, parse(["router", "--worker", "a:1", "b:2", "--worker", "c:3"]))
    assert router.workers == ["a:1", "b:2", "c:3"] and router.port == 30080
    replica = config_from_args(ReplicaCommand, parse([
        "serve", "replica", "--store", "s", "--gateway", "http://g:1", "--base-dir", "b", "--local-checkpoint-dir",
        "l", "--engine-arg=--x=1", "--engine-arg", "y", "--pause-mode", "in_place"]))
    assert replica.engine_args == ["--x=1", "y"] and replica.pause_mode == "in_place" and replica.port == 0
    assert config_from_args(ServiceBench, parse(["bench", "service", "--no-wake"])).wake is False
    assert config_from_args(ServiceBench, parse(["bench", "service"])).wake is True
    bench = config_from_args(AsyncBench, parse(["bench", "async", "--steps", "5", "--", "--lr", "1e-5"]))
    assert bench.steps == 5 and [a for a in bench.extra if a != "--"] == ["--lr", "1e-5"]


@pytest.mark.parametrize("argv, names", [
    (["engine", "--model-path", "m", "--dtype", "float8"], ("--dtype", "float8")),
    (["engine", "--model-path", "m", "--port", "x"], ("--port", "'x'")),
    (["engine", "--model-path", "m", "--max-running-requests", "0"], ("--max-running-requests",)),
    (["engine"], ("--model-path",)),
    (["weights"], ("ACTION",)),
    (["make-tiny-checkpoint", "--out", "never-written", "--num-heads", "0"], ("--num-heads",)),
    (["serve", "replica", "--store", "s", "--gateway", "g", "--base-dir", "b", "--local-checkpoint-dir", "l",
      "--engine", "ftp"], ("--engine", "ftp")),
    (["serve", "local", "--store", "s", "--base-dir", "b", "--lora-base-dir", "s.lora-v0", "--engine", "sglang"],
     ("--lora-base-dir", "--engine sglang", "--engine builtin")),
    (["agent", "--engine-url", "http://127.0.0.1:1", "--local-checkpoint-dir", "l", "--port", "0"], ("--port",)),
    (["bench", "async", "--steps", "2", "--warmup-steps", "3"], ("--steps", "--warmup-steps")),
])
def test_bad_values_exit_2_with_one_line_naming_the_flag(argv, names, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("miles-disagg") and "Traceback" not in err, err
    assert all(name in err for name in names), err
    assert list(tmp_path.iterdir()) == []  # nothing was written
