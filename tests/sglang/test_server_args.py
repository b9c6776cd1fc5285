"""Every SGLang command line the launcher builds, parsed by SGLang's own ``ServerArgs``.

``ServerArgs.add_cli_args`` + ``ServerArgs.from_cli_args`` is what ``sglang.launch_server``
runs on its argv. The parser here refuses abbreviations (SGLang's own accepts a unique
prefix), so a flag SGLang renamed is an error here rather than a silent prefix match.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from miles_disagg.config.sglang_args import parse_sglang_passthrough
from miles_disagg.engines.sglang import sglang_command

REPO = Path(__file__).resolve().parents[2]
BASE = dict(host="127.0.0.1", port=30001, tp_size=1, base_gpu_id=0, dtype="auto", weight_version=0)


class ArgvRefused(Exception):
    pass


class _StrictParser(argparse.ArgumentParser):
    def error(self, message):  # argparse would exit the test process
        raise ArgvRefused(message)


def parse(argv: list[str]):
    """SGLang's parsing of a ``python -m sglang.launch_server ...`` argv -> its ``ServerArgs``."""
    from sglang.srt.server_args import ServerArgs

    assert argv[1:3] == ["-m", "sglang.launch_server"], argv[:3]
    parser = _StrictParser(allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv[3:]))


def test_default_argv(sglang_loaded):
    args = parse(sglang_command("/models/qwen", **BASE, random_seed=1234))
    assert (args.model_path, args.host, args.port) == ("/models/qwen", "127.0.0.1", 30001)
    assert (args.tp_size, args.base_gpu_id, args.dtype) == (1, 0, "auto")
    assert args.weight_version == "0"
    assert args.random_seed == 1234
    assert args.trust_remote_code is True


def test_tp2_argv(sglang_loaded):
    args = parse(sglang_command("/models/qwen", **{**BASE, "tp_size": 2, "base_gpu_id": 4, "dtype": "bfloat16"},
                                random_seed=1))
    assert (args.tp_size, args.base_gpu_id, args.dtype, args.random_seed) == (2, 4, "bfloat16", 1)


def test_passthrough_flags_reach_sglang_with_their_values(sglang_loaded):
    options = parse_sglang_passthrough([
        "--sglang-mem-fraction-static", "0.7", "--sglang-enable-memory-saver", "--sglang-log-level=warning",
        "--sglang-chunked-prefill-size", "-1", "--sglang-max-running-requests", "128",
        "--sglang-cuda-graph-bs-decode", "1", "2", "4",
    ])
    args = parse(sglang_command("/m", **BASE, extra_args=options))
    assert args.mem_fraction_static == 0.7
    assert args.enable_memory_saver is True  # what --colocate's release/resume needs on GPU
    assert args.log_level == "warning"
    assert args.chunked_prefill_size == -1
    assert args.max_running_requests == 128
    assert list(args.cuda_graph_bs_decode) == [1, 2, 4]


def test_a_flag_sglang_does_not_know_is_refused_by_its_parser(sglang_loaded):
    """The judge can fail: a passthrough SGLang renamed (0.5.23 split --cuda-graph-bs) is refused."""
    with pytest.raises(ArgvRefused, match="cuda-graph-bs"):
        parse(sglang_command("/m", **BASE, extra_args={"cuda-graph-bs": ["1", "2"]}))


def _script_argv(script: Path, env: dict[str, str]) -> list[str]:
    """The train_async.py arguments of a launch script, with its environment variables filled in."""
    text = script.read_text()
    start = text.index("train_async.py", text.index("\nexec ")) + len("train_async.py")
    body = text[start:text.index('"$@"')]
    for name, value in env.items():
        body = body.replace(f'"${name}', f'"{value}').replace(f"${name}", value)
    body = re.sub(r"\$\{?work\}?", env["work"], body)
    return shlex.split(body.replace("\\\n", " "))


def test_the_8_gpu_scripts_engines_parse(sglang_loaded, tmp_path, monkeypatch):
    """scripts/run_qwen3_4B_disk_delta.sh: each engine's command as the manager builds it (the job's
    config, TP from --rollout-num-gpus-per-engine, --random-seed = --seed + engine index)."""
    from miles_disagg.config.actors import EngineManagerConfig
    from miles_disagg.config.loader import load_config

    model = tmp_path / "qwen3-4b"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}')
    prompts = tmp_path / "dapo.jsonl"
    prompts.write_text('{"prompt": [{"role": "user", "content": "1+1?"}], "label": "2"}\n')
    env = {"MILES_DISAGG_QWEN3_4B_DIR": str(model), "MILES_DISAGG_DAPO_MATH_JSONL": str(prompts),
           "work": str(tmp_path / "work")}
    argv = _script_argv(REPO / "scripts" / "run_qwen3_4B_disk_delta.sh", env)
    monkeypatch.chdir(tmp_path)
    config, _ = load_config(argv, "train_async")
    engines = EngineManagerConfig.from_run(config)
    tp = config.cluster.rollout_num_gpus_per_engine
    num_engines = config.cluster.rollout_num_gpus // tp
    assert (tp, num_engines) == (2, 2)
    for index in range(num_engines):
        cmd = sglang_command(str(model), host="127.0.0.1", port=30000 + index, tp_size=tp, base_gpu_id=index * tp,
                             dtype=engines.rollout.engine_dtype, weight_version=0, random_seed=engines.seed + index,
                             extra_args=engines.sglang_args)
        args = parse(cmd)
        assert (args.tp_size, args.base_gpu_id, args.random_seed) == (2, index * tp, engines.seed + index)
        assert args.mem_fraction_static == 0.8
        assert args.model_path == str(model) and args.weight_version == "0"
