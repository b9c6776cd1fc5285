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
from miles_disagg.config.miles_flags import REFUSED_FLAGS, check_refused, unknown_flags_error
from miles_disagg.config.resolve import resolve_derived
from miles_disagg.config.session_rules import session_server_argv
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
    parser.add_argument("--dry-run", action="store_true",
                        help="Check everything that can be checked without starting anything, print the launch plan "
                             "(placement, every process with its argv, the delta filter) as one JSON object, exit.")
    for section, specs in all_flag_specs().items():
        group = parser.add_argument_group(section)
        for spec in specs:
            add_flag(group, spec)  # defaults are applied later (after YAML): unset flags stay absent
    refused = parser.add_argument_group("miles flags refused here (each says why and what to use)")
    for item in REFUSED_FLAGS.values():
        refused.add_argument(item.flag, dest=item.dest, nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


MODES = ("run", "print-config", "dry-run")


def load_config(argv: Sequence[str] | None, entry: str) -> tuple[RunConfig, bool]:
    """Parse ``argv`` for ``entry`` (train | train_async); return (validated config, print_config)."""
    config, mode = load_launch(argv, entry)
    return config, mode == "print-config"


def load_launch(argv: Sequence[str] | None, entry: str) -> tuple[RunConfig, str]:
    """Parse ``argv`` for ``entry``; return (validated config, mode): ``run``, ``print-config``
    (``--print-config``) or ``dry-run`` (``--dry-run``)."""
    from miles_disagg.config.sglang_args import split_sglang_passthrough

    argv = session_server_argv(list(sys.argv[1:] if argv is None else argv))  # miles' --use-session-server v2
    # --sglang-* go to managed SGLang servers as they are, except the job's own --sglang-* flags
    sglang_args, argv = split_sglang_passthrough(argv, consumed=job_sglang_flags())
    parser = build_parser(entry)
    parsed, unknown = parser.parse_known_args(argv)
    if unknown:
        raise with_suggestions(unknown_flags_error(entry, unknown), known_flags(parser), entry)
    args = vars(parsed)
    config_path = args.pop("config", None)
    modes = [mode for mode, key in (("print-config", "print_config"), ("dry-run", "dry_run")) if args.pop(key, False)]
    if len(modes) > 1:
        raise ConfigError("--print-config and --dry-run: give one", ("--print-config", "--dry-run"))
    refused = [item.flag for item in REFUSED_FLAGS.values() if args.pop(item.dest, None) is not None]
    values = _read_yaml(Path(config_path)) if config_path else {}
    refused += values.pop(_REFUSED_KEY, [])
    bind_checkpoint_init(values, args)
    values.update(args)  # the command line wins
    config = _build(values, entry)
    config.sglang_args = sglang_args
    check_refused(refused, rollout_external=config.rollout.rollout_external)
    fill_run_paths(config)
    resolve_derived(config)
    validate(config)
    return config, modes[0] if modes else "run"


def bind_checkpoint_init(yaml_values: dict[str, Any], cli_args: dict[str, Any]) -> None:
    """A YAML ``hf_checkpoint_init`` makes a model only at that YAML's own ``hf_checkpoint``: with
    another ``--hf-checkpoint`` on the command line the path is used as it is, as without the init
    key (a typo'd path exits 2 instead of training a random model made there). Passing
    ``--hf-checkpoint-init`` on the command line asks for a model at the given path."""
    import os

    init, configured = yaml_values.get("hf_checkpoint_init"), yaml_values.get("hf_checkpoint")
    if "hf_checkpoint_init" in cli_args or init in (None, "none") or configured is None:
        return
    given = cli_args.get("hf_checkpoint")
    if given is None or os.path.abspath(str(given)) == os.path.abspath(str(configured)):
        return
    yaml_values["hf_checkpoint_init"] = "none"
    if not Path(str(given)).is_dir():
        raise ConfigError(f"--hf-checkpoint {str(given)!r} is not a local directory (the config's hf_checkpoint_init "
                          f"{init} makes a model only at its own hf_checkpoint {configured!r}; add "
                          f"--hf-checkpoint-init {init} to make one at {str(given)!r})",
                          ("--hf-checkpoint", "--hf-checkpoint-init"))


def closest(name: str, candidates: Sequence[str]) -> str | None:
    """The candidate nearest ``name`` (a typo's likely meaning), or None when none is close."""
    import difflib

    matches = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75)
    return matches[0] if matches else None


def known_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string the parser takes (``--no-x`` forms included), refused miles flags left out."""
    refused = set(REFUSED_FLAGS)
    return sorted(option for action in parser._actions for option in action.option_strings
                  if option.startswith("--") and option not in refused)


def with_suggestions(error: ConfigError, flags: Sequence[str], entry: str) -> ConfigError:
    """``error`` (unknown flags) with "did you mean" for each flag that is a likely typo of a known one
    (when every one is, just those lines: the typo's cause is plain)."""
    hints = {flag_name: closest(flag_name, flags) for flag_name in error.flags}
    found = [f"{flag_name}: not a flag of {entry}.py; did you mean {hint}?" for flag_name, hint in hints.items() if hint]
    if not found:
        return error
    if len(found) == len(hints):
        return ConfigError("; ".join(found), error.flags)
    return ConfigError(f"{error} ({'; '.join(found)})", error.flags)


def job_sglang_flags() -> frozenset[str]:
    """``--sglang-*`` flags the job itself takes (never passed through to SGLang)."""
    flags = {spec.flag for specs in all_flag_specs().values() for spec in specs}
    flags |= set(REFUSED_FLAGS)
    return frozenset(f for f in flags if f.startswith("--sglang-"))


def fill_run_paths(config: RunConfig, now: float | None = None) -> None:
    """Default paths inside the run directory: ``--run-dir`` itself (``runs/<timestamp>-<random>``:
    unique even for runs started in the same second) and, for disk-delta, the publication dir and
    the host-local checkpoint dir when not given."""
    import secrets
    import time

    tracking, weights = config.tracking, config.weights
    if tracking.run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        tracking.run_dir = str(Path("runs") / f"{stamp}-{secrets.token_hex(3)}")
    if tracking.dump_details and config.rollout.save_debug_rollout_data is None:  # miles' --dump-details
        config.rollout.save_debug_rollout_data = str(Path(tracking.dump_details) / "rollout_data" / "{rollout_id}.jsonl")
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


_REFUSED_KEY = "__refused__"


def _flatten(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    known = {spec.dest for specs in all_flag_specs().values() for spec in specs}
    refused = {item.yaml_key: item.flag for item in REFUSED_FLAGS.values()}
    flat: dict[str, Any] = {_REFUSED_KEY: []}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name in SECTIONS and isinstance(value, dict):
            inner = _flatten(value, path)
            flat[_REFUSED_KEY] += inner.pop(_REFUSED_KEY)
            flat.update(inner)
        elif name in known:
            flat[name] = value
        elif name in refused:
            flat[_REFUSED_KEY].append(refused[name])
        else:
            hint = closest(name, sorted(known | set(refused) | set(SECTIONS)))
            raise ConfigError(f"--config {str(path)!r}: unknown key {key!r}"
                              + (f" (did you mean {hint!r}?)" if hint else ""), ("--config",))
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


def config_to_namespace(config: RunConfig) -> argparse.Namespace:
    """The run's flags as one flat namespace under miles' names (``args.update_weight_disk_dir``),
    with the ``--sglang-*`` passthrough as ``args.sglang_<name>``: what miles-signature hooks receive."""
    import dataclasses

    flat: dict[str, Any] = {"entry": config.entry}
    for section in SECTIONS:
        flat.update(dataclasses.asdict(getattr(config, section)))
    for name, value in config.sglang_args.items():
        flat["sglang_" + name.replace("-", "_")] = value
    return argparse.Namespace(**flat)
