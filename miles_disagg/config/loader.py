"""Flags + YAML -> one validated :class:`RunConfig`.

Precedence: field defaults < ``--config file.yaml`` < the command line. The YAML may
be flat (``rollout_batch_size: 4`` or ``rollout-batch-size: 4``) or grouped by
component (``rollout: {rollout_batch_size: 4}``). Unknown keys, wrong types and
invalid choices fail with a ``ConfigError`` that names the flag; nothing starts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

from miles_disagg.config.components import SECTIONS, RunConfig
from miles_disagg.config.fields import ConfigArgumentParser, FlagSpec, add_flag, build_config, flag_specs
from miles_disagg.config.validate import validate
from miles_disagg.types import ConfigError

ENTRY_DESCRIPTIONS = {
    "train": "Synchronous RL training: rollout, then train, then update weights (supports --colocate).",
    "train_async": "Fully async RL training: rollout stays in flight while the trainer consumes completed groups.",
}


def all_flag_specs() -> dict[str, list[FlagSpec]]:
    return {section: flag_specs(cls) for section, cls in SECTIONS.items()}


def build_parser(entry: str) -> argparse.ArgumentParser:
    parser = ConfigArgumentParser(prog=f"{entry}.py", description=ENTRY_DESCRIPTIONS[entry],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML file setting any flag (the command line wins).")
    parser.add_argument("--print-config", action="store_true", help="Print the resolved config and exit.")
    for section, specs in all_flag_specs().items():
        group = parser.add_argument_group(section)
        for spec in specs:
            add_flag(group, spec)  # defaults are applied later (after YAML): unset flags stay absent
    return parser


def load_config(argv: Sequence[str] | None, entry: str) -> tuple[RunConfig, bool]:
    """Parse ``argv`` for ``entry`` (train | train_async); return (validated config, print_config)."""
    from miles_disagg.config.sglang_args import split_sglang_passthrough

    argv = list(sys.argv[1:] if argv is None else argv)
    sglang_args, argv = split_sglang_passthrough(argv)  # --sglang-* go to managed SGLang servers as they are
    args = vars(build_parser(entry).parse_args(argv))
    config_path = args.pop("config", None)
    print_config = args.pop("print_config", False)
    values = _read_yaml(Path(config_path)) if config_path else {}
    values.update(args)  # the command line wins
    config = _build(values, entry)
    config.sglang_args = sglang_args
    fill_run_paths(config)
    validate(config)
    return config, print_config


def fill_run_paths(config: RunConfig, now: float | None = None) -> None:
    """Default paths inside the run directory: ``--run-dir`` itself (``runs/<timestamp>``) and,
    for disk-delta, the publication dir and the host-local checkpoint dir when not given."""
    import time

    tracking, weights = config.tracking, config.weights
    if tracking.run_dir is None:
        tracking.run_dir = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.localtime(now)))
    if weights.update_weight_transfer_mode == "disk-delta":
        run_dir = Path(tracking.run_dir)
        if config.rollout.rollout_service_url is None:  # a service reads the store it was given: no default
            weights.update_weight_disk_dir = weights.update_weight_disk_dir or str(run_dir / "weight-updates")
        weights.update_weight_local_checkpoint_dir = (
            weights.update_weight_local_checkpoint_dir or str(run_dir / "rollout-checkpoints"))


def _read_yaml(path: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not path.is_file():
        raise ConfigError(f"--config {str(path)!r}: no such file", ("--config",))
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(f"--config {str(path)!r}: cannot parse YAML: {exc}", ("--config",)) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {str(path)!r}: expected a mapping of flag names to values", ("--config",))
    return _flatten(raw, path)


def _flatten(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    known = {spec.dest for specs in all_flag_specs().values() for spec in specs}
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name in SECTIONS and isinstance(value, dict):
            flat.update(_flatten(value, path))
        elif name in known:
            flat[name] = value
        else:
            raise ConfigError(f"--config {str(path)!r}: unknown key {key!r}", ("--config",))
    return flat


def _build(values: dict[str, Any], entry: str) -> RunConfig:
    sections = {section: build_config(cls, values) for section, cls in SECTIONS.items()}
    return RunConfig(entry=entry, **sections)


def config_to_dict(config: RunConfig) -> dict[str, Any]:
    """The resolved config as plain data; keys (``SECRET_FIELDS``) are shown as ``<redacted>``."""
    import dataclasses

    from miles_disagg.config.components import REDACTED, SECRET_FIELDS

    data = dataclasses.asdict(config)
    for section in data.values():
        if isinstance(section, dict):
            for name in SECRET_FIELDS & section.keys():
                section[name] = REDACTED if section[name] is not None else None
    return data


def config_to_yaml(config: RunConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(config_to_dict(config)))
