"""Agentic rollout through the session endpoint, as a user runs it: ``train_async.py --use-session-server
--custom-agent-function-path session_agent.run_agent`` (miles' flags), the agent written with the official
``openai`` client (``tests/e2e/session_agent.py``): two policy turns around a counter tool's answer (a
``tool`` message), on the count-up-tool task. The policy learns; every consumed sample is one session,
token-exact: the tool's tokens masked, one engine call per turn recorded, the reward the task's on the
agent's positions; the endpoint is listed in ``placement.json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from base_model import place_base_model
from deadlines import scaled

from miles_disagg.tracking import read_metrics

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STEPS = 20
CONCAT_TEMPLATE = "{%- for message in messages %}{{ message.content }}{%- endfor %}"
"""Messages as their contents, one after another: the digits model's episode as the multi-turn example has it."""


LEARNING_ENV = "MILES_DISAGG_SESSION_LEARNING_RUN"
"""Set to 1 to run the 20-step learning run too (115 CPU-seconds: over what the suite may add; its recorded
figures are in docs/rollout-extensions.md)."""


def _run(tmp_path: Path, base: Path, steps: int, sizes: list[str], **extra_env: str) -> Path:
    place_base_model(base, tmp_path)
    (tmp_path / "concat.jinja").write_text(CONCAT_TEMPLATE)
    run_dir = tmp_path / "run"
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled", **extra_env,
           "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)}
    argv = [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
            "--task", "count-up-tool", "--use-session-server", "--custom-agent-function-path",
            "session_agent.run_agent", "--tito-model", "default", "--tito-allowed-append-roles", "tool",
            "--chat-template-path", str(tmp_path / "concat.jinja"), "--rollout-max-response-len", "6", *sizes,
            "--num-rollout", str(steps), "--run-dir", str(run_dir), "--hf-checkpoint", str(tmp_path / "base-model"),
            "--save-debug-rollout-data", str(run_dir / "consumed" / "{rollout_id}.jsonl")]
    result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=scaled(900), env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    return run_dir


def _check_samples(run_dir: Path, step: int) -> int:
    """Every consumed sample checked; how many were a retry's branch."""
    from miles_disagg.rollout.counter_tool import count_up_tool_reward

    two_turns, retries = 0, 0
    for line in (run_dir / "consumed" / f"{step}.jsonl").read_text().splitlines():
        for sample in json.loads(line)["samples"]:
            session = sample["metadata"]["session"]
            turns = session["num_turns"]
            if session["num_branches"] == 2 and session["branch"]["path"] == [1]:  # the retried first turn
                retries += 1
                assert turns == 1 and sample["loss_mask"] == [1] * len(sample["response_ids"])
            assert len(sample["call_versions"]) == turns == len(sample["metadata"]["session"]["turn_versions"])
            if turns == 2:  # the tool's two tokens sit between the policy's turns, masked
                two_turns += 1
                second = len(sample["response_ids"]) - 4  # the second turn: 2 tokens, or 1 when it ended on EOS
                assert second in (1, 2) and sample["loss_mask"] == [1, 1, 0, 0] + [1] * second, sample["loss_mask"]
                assert sample["response"] == sample["metadata"]["agent_response"]
            assert sample["reward"] == count_up_tool_reward(sample["prompt"], sample["response"], 4, sample["metadata"])
    assert two_turns > 0
    return retries


def test_an_openai_client_agent_trains_through_the_session_endpoint(tmp_path: Path, digits_base_model: Path) -> None:
    """Three steps: the endpoint in placement.json, every consumed sample a token-exact branch of a session
    (the agent retries its first turn in about half the sessions: those sessions give two samples each, and
    the rollout's samples beyond whole global batches are trimmed, as miles trims them)."""
    run_dir = _run(tmp_path, digits_base_model, 3, ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
                                                    "--global-batch-size", "16", "--micro-batch-size", "16"],
                   SESSION_AGENT_RETRIES="1")
    placement = json.loads((run_dir / "placement.json").read_text())
    assert placement["sessions"]["address"].startswith("http://127.0.0.1:")
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert len(metrics) == 3 and metrics[-1]["rollout/sessions/sessions_finished"] >= 3 * 16
    assert metrics[-1].get("rollout/sessions/prefix_mismatches", 0) == 0
    assert metrics[-1]["rollout/sessions/session_samples"] > metrics[-1]["rollout/sessions/sessions_finished"]
    assert any(m.get("rollout/trimmed_samples", 0) > 0 for m in metrics)
    assert sum(_check_samples(run_dir, step) for step in range(3)) > 0


@pytest.mark.skipif(os.environ.get(LEARNING_ENV) != "1", reason=f"the 20-step learning run (115 CPU-s); {LEARNING_ENV}=1")
def test_an_openai_client_agent_learns_through_the_session_endpoint(tmp_path: Path, digits_base_model: Path) -> None:
    run_dir = _run(tmp_path, digits_base_model, STEPS, [
        "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "64",
        "--micro-batch-size", "64", "--lr", "3e-3", "--rollout-concurrency", "128"])
    rewards = [m["rollout/raw_reward"] for m in read_metrics(run_dir / "metrics.jsonl")]
    print("rewards", [round(r, 3) for r in rewards])
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last >= first + 0.2, rewards
    _check_samples(run_dir, STEPS - 1)
