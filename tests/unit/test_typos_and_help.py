"""A typo'd flag or YAML key gets "did you mean"; ``--help`` metavars say what a value is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from miles_disagg.config import load_config
from miles_disagg.config.loader import build_parser
from miles_disagg.types import ConfigError


def test_a_typod_flag_names_the_flag_it_is_close_to() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(["--rollout-batch-sise", "4"], "train_async")
    assert str(info.value) == "--rollout-batch-sise: not a flag of train_async.py; did you mean --rollout-batch-size?"
    assert info.value.flags == ("--rollout-batch-sise",)
    with pytest.raises(ConfigError, match="--no-colocte: not a flag of train.py; did you mean --no-colocate"):
        load_config(["--no-colocte"], "train")


def test_a_flag_close_to_nothing_keeps_the_miles_explanation() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(["--frobnicate-everything"], "train_async")
    assert "did you mean" not in str(info.value) and "not a flag of train_async.py" in str(info.value)


def test_a_typod_yaml_key_names_the_key_it_is_close_to(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  n_samples_per_promt: 4\n")
    with pytest.raises(ConfigError, match="unknown key 'n_samples_per_promt' \\(did you mean 'n_samples_per_prompt'\\?\\)"):
        load_config(["--config", str(path)], "train_async")
    path.write_text("rolout:\n  n_samples_per_prompt: 4\n")
    with pytest.raises(ConfigError, match="did you mean 'rollout'"):
        load_config(["--config", str(path)], "train_async")


def test_subcommands_suggest_too() -> None:
    from miles_disagg.cli import main

    with pytest.raises(SystemExit):
        main(["engine", "--help"])  # the engine's parser builds (argparse exits 0 after help)
    assert main(["bench", "http", "--reqests", "3"]) == 2


def test_subcommand_typo_message(capsys) -> None:
    from miles_disagg.cli import main

    assert main(["router", "--prot", "1"]) == 2
    assert "--prot: did you mean --port?" in capsys.readouterr().err


@pytest.mark.parametrize("flag, metavar", [
    ("--actor-num-gpus-per-node", "N"), ("--n-samples-per-prompt", "N"), ("--num-rollout", "N"), ("--lr", "X"),
    ("--hf-checkpoint", "DIR"), ("--prompt-data", "PATH"), ("--custom-rm-path", "MODULE:FUNCTION"),
    ("--rollout-service-url", "URL"), ("--sglang-router-port", "PORT"), ("--input-key", "FIELD"),
])
def test_help_metavars_say_what_the_value_is(flag: str, metavar: str) -> None:
    text = build_parser("train_async").format_help()
    assert re.search(rf"\s{re.escape(flag)} {re.escape(metavar)}\b", text), flag


def test_no_help_metavar_is_the_last_word_of_a_counting_flag() -> None:
    text = build_parser("train_async").format_help()
    for bad in ("--actor-num-gpus-per-node NODE", "--n-samples-per-prompt PROMPT", "--num-rollout ROLLOUT"):
        assert bad not in text
