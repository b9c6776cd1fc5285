"""An FP8 checkpoint made by ``miles-disagg convert-fp8`` is what SGLang 0.5.23 loads as blockwise FP8:
its own model config detects ``fp8`` and its Fp8Config reads the block size, and the launch plan of
a job on it parses with SGLang's ServerArgs (SGLang takes the quantization from config.json: the plan
adds no flag of its own, and ``--sglang-quantization fp8`` passes through)."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_server_args import parse

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_qwen3_dir: Path, tmp_path_factory) -> Path:
    from miles_disagg.models.fp8 import BlockFp8
    from miles_disagg.weights.fp8_convert import convert_checkpoint

    out = tmp_path_factory.mktemp("sglang-fp8") / "fp8"
    convert_checkpoint(tiny_qwen3_dir, out, BlockFp8((128, 128)))
    return out


def test_sglang_reads_the_converted_checkpoint_as_blockwise_fp8(sglang_loaded, fp8_checkpoint):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.server_args import ServerArgs

    model_config = ModelConfig.from_server_args(ServerArgs(model_path=str(fp8_checkpoint)))
    assert model_config.quantization == "fp8"
    quant = model_config.hf_config.quantization_config
    fp8 = Fp8Config.from_config(quant if isinstance(quant, dict) else quant.to_dict())
    assert fp8.weight_block_size == [128, 128]
    assert fp8.is_checkpoint_fp8_serialized and fp8.activation_scheme == "dynamic"


@pytest.mark.parametrize("extra", [[], ["--sglang-quantization", "fp8"]])
def test_the_launch_plan_of_an_fp8_job_parses(sglang_loaded, fp8_checkpoint, extra):
    from miles_disagg.config import load_config
    from miles_disagg.config.actors import EngineManagerConfig
    from miles_disagg.engines.launch import engine_processes
    from miles_disagg.fleet.plan import engine_specs

    config, _ = load_config(["--hf-checkpoint", str(fp8_checkpoint), "--rollout-num-gpus-per-engine", "1", *extra],
                            "train_async")
    spec = engine_specs(EngineManagerConfig.from_run(config), [[0]], "sglang")[0]
    args = parse(engine_processes(spec, port=30000)[0].argv)
    assert args.model_path == str(fp8_checkpoint)
    assert args.quantization == ("fp8" if extra else None)
