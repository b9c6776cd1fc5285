"""Prompt data that preflight cannot see fail (a chat template that fails on a record: preflight does not
render) ends the run with its ``ConfigError`` as the rollout manager starts (the launcher's exit 2 and
one line naming the file and line), not as a dead actor found a minute later (exit 1, three tracebacks;
issue 34)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from deadlines import scaled
from rollout_fixtures import ray_session

from miles_disagg.config.actors import RolloutManagerConfig
from miles_disagg.config.components import RolloutConfig
from miles_disagg.types import ConfigError

pytestmark = pytest.mark.timeout(scaled(240))


def test_a_record_the_chat_template_fails_on_is_a_config_error_from_the_handle(tmp_path: Path) -> None:
    from miles_disagg.launcher import _cause
    from miles_disagg.models.tiny_qwen3 import DIGITS_CHARSET, build_tokenizer
    from miles_disagg.rollout.handle import RolloutManagerHandle

    hf_dir = tmp_path / "tokenizer"
    build_tokenizer(DIGITS_CHARSET).save_pretrained(hf_dir)  # no chat template: rendering fails on every record
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": "1+1", "label": "2"}) + "\n" for _ in range(3)))
    config = RolloutConfig(prompt_data=str(data), input_key="prompt", label_key="label", apply_chat_template=True,
                           rollout_batch_size=1, n_samples_per_prompt=1, rm_type="math")
    with ray_session(num_gpus=0):
        start = time.monotonic()
        with pytest.raises(ConfigError) as info:
            RolloutManagerHandle(RolloutManagerConfig(rollout=config, router_url="http://127.0.0.1:9", hf_dir=str(hf_dir)))
        took = time.monotonic() - start
        cause = str(_cause(info.value))
        assert cause.startswith(f"--prompt-data: {data}:1: the chat template failed"), cause
        assert took < scaled(60), took  # no grace for a dead actor's cause: the error itself, at once
