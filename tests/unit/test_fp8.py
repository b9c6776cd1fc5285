"""The blockwise-FP8 rule (models/fp8.py), the served form of a run's versions (weights/served_form.py)
and ``miles-disagg convert-fp8``'s refusals, against an independent reading of the format: per block,
scale = max|W| / 448 (max clamped away from zero), weight = W / scale rounded to e4m3."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from miles_disagg.models.fp8 import (
    BlockFp8, MIN_BLOCK_MAX, dequantize, dequantize_state, is_quantized_weight, quantize, quantize_named, scheme_of,
)
from miles_disagg.types import ConfigError, FormatError
from miles_disagg.weights.served_form import ServedForm


def reference_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block with Python loops (float64 max, float32 division)."""
    rows, cols = w.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    scale = torch.empty(nr, nc, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            s = torch.tensor(max(float(part.abs().max()), MIN_BLOCK_MAX), dtype=torch.float32) / 448.0
            scale[i, j] = s
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = \
                (part / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


@pytest.mark.parametrize("shape", [(64, 64), (70, 33), (5, 200), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_matches_the_blockwise_definition_with_partial_edge_blocks(shape, dtype):
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)
    q, s = quantize(w, (32, 32))
    rq, rs = reference_quantize(w, (32, 32))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (-(-shape[0] // 32), -(-shape[1] // 32))
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    error = (dequantize(q, s, (32, 32)) - w.float()).abs()
    bound = s.repeat_interleave(32, 0).repeat_interleave(32, 1)[:shape[0], :shape[1]] * 448 / 16  # e4m3: 3 bits
    assert bool((error <= bound + 1e-12).all())


def test_a_zero_block_has_a_finite_scale_and_zero_values():
    w = torch.zeros(16, 48)
    w[:, 32:] = 1.0
    q, s = quantize(w, (16, 16))
    assert torch.isfinite(s).all() and float(s[0, 0]) == pytest.approx(MIN_BLOCK_MAX / 448)
    assert float(q[:, :32].float().abs().max()) == 0.0 and float(q[:, 32:].float().max()) == 448.0


def test_the_same_values_give_the_same_bytes_whatever_their_dtype_or_layout():
    w = torch.randn(40, 72, dtype=torch.bfloat16)
    a = quantize(w, (16, 16))
    b = quantize(w.float().t().contiguous().t(), (16, 16))
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_only_two_dimensional_tensors_are_quantized():
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.ones(4), (2, 2))
    with pytest.raises(FormatError, match="does not cover"):
        dequantize(torch.zeros(8, 8, dtype=torch.float8_e4m3fn), torch.ones(1, 1), (4, 4))


@pytest.mark.parametrize("name,shape,expected", [
    ("model.layers.0.self_attn.q_proj.weight", (8, 8), True),
    ("model.layers.0.mlp.gate_proj.weight", (8, 8), True),
    ("model.layers.0.mlp.experts.3.down_proj.weight", (8, 8), True),
    ("model.layers.0.mlp.gate.weight", (4, 8), False),  # the MoE router
    ("model.embed_tokens.weight", (16, 8), False),
    ("lm_head.weight", (16, 8), False),
    ("model.layers.0.input_layernorm.weight", (8,), False),
    ("model.layers.0.self_attn.q_norm.weight", (8,), False),
    ("model.norm.weight", (8,), False),
])
def test_which_tensors_are_stored_as_fp8(name, shape, expected):
    assert is_quantized_weight(name, shape) is expected


def test_the_quantization_config_is_read_and_others_are_refused():
    assert scheme_of({}) is None
    scheme = BlockFp8((128, 128))
    assert scheme_of({"quantization_config": scheme.quantization_config()}) == scheme
    assert scheme.quantization_config() == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "weight_block_size": [128, 128]}
    for method in ("awq", "gptq", "modelopt_fp4", "mxfp8", "compressed-tensors"):
        with pytest.raises(ConfigError, match=method):
            scheme_of({"quantization_config": {"quant_method": method}})
    with pytest.raises(ConfigError, match="per-tensor"):
        scheme_of({"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(FormatError):
        scheme_of({"quantization_config": {"quant_method": "fp8", "weight_block_size": [0, 128]}})


def test_dequantize_state_folds_scales_and_refuses_an_orphan_scale():
    q, s = quantize(torch.randn(8, 8), (4, 4))
    state = {"a.weight": q, "a.weight_scale_inv": s, "n.weight": torch.ones(8)}
    out = dequantize_state(state, BlockFp8((4, 4)), torch.float32)
    assert set(out) == {"a.weight", "n.weight"} and out["a.weight"].dtype == torch.float32
    with pytest.raises(FormatError, match="without their weights"):
        dequantize_state({"b.weight_scale_inv": s}, BlockFp8((4, 4)), torch.float32)


def test_the_served_form_keeps_a_scale_with_its_weight_and_quantizes_only_owned_weights():
    form = ServedForm(BlockFp8((4, 4)), {"a.weight", "b.weight"})
    share = form.share_with_scales({"a.weight", "b.weight_scale_inv", "n.weight"})
    assert share == {"a.weight", "a.weight_scale_inv", "n.weight"}
    named = [("a.weight", torch.randn(8, 8)), ("b.weight", torch.randn(8, 8)), ("n.weight", torch.ones(8))]
    served = dict(form.served_tensors(named, owned=share))
    assert list(served) == ["a.weight", "a.weight_scale_inv", "n.weight"]
    assert served["a.weight"].dtype == torch.float8_e4m3fn
    assert dict(quantize_named(named[:1], BlockFp8((4, 4))))["a.weight_scale_inv"].shape == (2, 2)
    assert ServedForm().served_tensors(named, owned=()) is not None and not ServedForm().quantized


def test_an_fp8_checkpoint_whose_weights_and_scales_do_not_pair_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": BlockFp8().quantization_config()}))
    with pytest.raises(FormatError, match="without a scale"):
        ServedForm.of_checkpoint(tmp_path, {"a.weight": "F8_E4M3"})
    with pytest.raises(FormatError, match="scales without"):
        ServedForm.of_checkpoint(tmp_path, {"a.weight": "BF16", "a.weight_scale_inv": "F32"})
    assert ServedForm.of_checkpoint(tmp_path, {"a.weight": "F8_E4M3", "a.weight_scale_inv": "F32"}).quantized


def convert(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "miles_disagg.cli", "convert-fp8", *argv], capture_output=True,
                          text=True, timeout=120)


def test_convert_fp8_refuses_bad_input_with_one_line_and_writes_nothing(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    missing = convert("--model-dir", str(model), "--save-dir", str(tmp_path / "out"))
    assert missing.returncode == 2 and "no config.json" in missing.stderr and not (tmp_path / "out").exists()
    (model / "config.json").write_text(json.dumps({"quantization_config": BlockFp8().quantization_config()}))
    already = convert("--model-dir", str(model), "--save-dir", str(tmp_path / "out"))
    assert already.returncode == 2 and "already FP8" in already.stderr
    (model / "config.json").write_text("{}")
    from safetensors.torch import save_file

    save_file({"w.weight": torch.ones(4, 4)}, model / "model.safetensors")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep").write_text("x")
    refused = convert("--model-dir", str(model), "--save-dir", str(busy))
    assert refused.returncode == 2 and "--force" in refused.stderr and (busy / "keep").exists()
    bad_block = convert("--model-dir", str(model), "--save-dir", str(tmp_path / "o2"), "--block-size", "128")
    assert bad_block.returncode == 2 and "--block-size" in bad_block.stderr
    for result in (missing, already, refused, bad_block):
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("flag", ["--fp8-format", "--fp8-recipe", "--fp8-param-gather"])
def test_megatron_fp8_training_flags_are_refused_with_one_line_naming_the_fp8_rollout_path(flag):
    from miles_disagg.config import load_config

    with pytest.raises(ConfigError) as refused:
        load_config(["--hf-checkpoint", "/x", flag, "e4m3"], "train_async")
    message = str(refused.value)
    assert message.startswith(f"{flag} is a miles flag") and "convert-fp8" in message and "\n" not in message


def test_an_fp8_base_needs_a_full_precision_trainer_source_and_the_disk_delta_path(tmp_path):
    from miles_disagg.config import load_config
    from miles_disagg.loop.quantized_base import check_quantized_base

    base = tmp_path / "fp8"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"quantization_config": BlockFp8().quantization_config()}))

    def check(*extra: str, backend: str = "fsdp", mode: str = "disk-delta"):
        config, _ = load_config(["--hf-checkpoint", str(base), "--train-backend", backend,
                                 "--update-weight-transfer-mode", mode, *extra], "train_async")
        return check_quantized_base(config)

    with pytest.raises(ConfigError, match="--train-hf-checkpoint BF16_DIR"):
        check()
    with pytest.raises(ConfigError, match="broadcast"):
        check("--train-from-dequantized-checkpoint", mode="broadcast")
    assert "FP8 rollout" in check("--train-from-dequantized-checkpoint")
    with pytest.raises(ConfigError, match="fsdp"):
        check("--train-from-dequantized-checkpoint", backend="megatron")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    config, _ = load_config(["--hf-checkpoint", str(plain), "--train-hf-checkpoint", str(base)], "train_async")
    with pytest.raises(ConfigError, match="applies only to a quantized"):
        check_quantized_base(config)
