"""Load a checkpoint's causal LM: the native Qwen3 or Qwen3-MoE on CPU where it computes what
transformers computes, transformers' ``AutoModelForCausalLM`` everywhere else.

On a CPU the model's start-up is most of an engine's or a trainer rank's work before its first
request, and transformers' import alone is about 5 CPU-seconds of it; on a GPU it is noise
beside loading real weights, and transformers' kernels are the ones run and checked there, so
CUDA devices always get transformers. :func:`implementation` says which one a checkpoint gets.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from miles_disagg.types import InvalidInput, LayoutMismatch

NATIVE, TRANSFORMERS = "native", "transformers"


def read_config(model_dir: Path) -> dict:
    """``config.json`` of a checkpoint directory; ``InvalidInput`` when absent or unreadable."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise InvalidInput(f"model_path {str(model_dir)!r} is not a checkpoint directory (no config.json)")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"config.json in {str(model_dir)!r} is unreadable: {exc}") from exc


def checkpoint_dtype(model_dir: Path) -> torch.dtype:
    """The checkpoint's declared ``dtype``/``torch_dtype`` (float32 when absent)."""
    config = read_config(model_dir)
    declared = config.get("dtype") or config.get("torch_dtype") or "float32"
    return getattr(torch, str(declared), torch.float32)


def implementation(model_dir: Path, device: torch.device | str = "cpu") -> tuple[str, str]:
    """``(NATIVE or TRANSFORMERS, why)`` for the checkpoint at ``model_dir`` on ``device``."""
    from miles_disagg.models import qwen3, qwen3_moe

    if torch.device(device).type != "cpu":
        return TRANSFORMERS, f"{torch.device(device).type} device"
    config = read_config(model_dir)
    if qwen3_moe.is_moe_config(config):
        blocker = qwen3_moe.native_blocker(config)
        return (TRANSFORMERS, blocker) if blocker else (NATIVE, "Qwen3-MoE on CPU")
    blocker = qwen3.native_blocker(config)
    return (TRANSFORMERS, blocker) if blocker else (NATIVE, "Qwen3 on CPU")


def load_causal_lm(model_dir: Path, *, dtype: torch.dtype | str = "auto", device: torch.device | str = "cpu",
                   runs_on: torch.device | str | None = None, dequantize: bool = False) -> torch.nn.Module:
    """The checkpoint's model in ``dtype`` (``auto``: the checkpoint's) on ``device``, in eval mode;
    ``runs_on``: the device it will compute on, if the caller moves it (default: ``device``).
    ``dequantize``: a blockwise-FP8 checkpoint becomes the unquantized model of its dequantized
    weights (a trainer's starting point); without it such a checkpoint keeps its FP8 layers."""
    model_dir = Path(model_dir)
    dtype = checkpoint_dtype(model_dir) if dtype == "auto" else dtype
    if dequantize and "quantization_config" in read_config(model_dir):
        return load_dequantized(model_dir, dtype=dtype, device=device)
    choice, why = implementation(model_dir, device if runs_on is None else runs_on)
    if choice == NATIVE:
        return load_native_qwen3(model_dir, dtype=dtype, device=device)
    if "quantization_config" in read_config(model_dir):
        raise InvalidInput(f"checkpoint {str(model_dir)!r} is quantized and the native model cannot serve it "
                           f"({why}): serve quantized checkpoints with SGLang (--engine sglang)")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def native_classes(config_json: dict) -> tuple[type, type]:
    """``(config class, model class)`` of the native implementation for a config.json."""
    from miles_disagg.models import qwen3, qwen3_moe

    if qwen3_moe.is_moe_config(config_json):
        return qwen3_moe.Qwen3MoeConfig, qwen3_moe.Qwen3MoeForCausalLM
    return qwen3.Qwen3Config, qwen3.Qwen3ForCausalLM


def load_native_qwen3(model_dir: Path, *, dtype: torch.dtype, device: torch.device | str = "cpu"):
    """The native Qwen3 (:mod:`~miles_disagg.models.qwen3`) or Qwen3-MoE
    (:mod:`~miles_disagg.models.qwen3_moe`) with the checkpoint's tensors."""
    from safetensors.torch import load_file

    config_json = read_config(model_dir)
    config_class, model_class = native_classes(config_json)
    config = config_class.from_dict(config_json)
    model = model_class(config)  # uninitialised: every tensor comes from the checkpoint
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    stored_as_is = _use_quantized_layers(model, config_json, tensors, dtype)
    expected = dict(model.named_parameters(remove_duplicate=False))
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(set(expected) - set(tensors) - tied)
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise LayoutMismatch(f"checkpoint {str(model_dir)!r} does not hold a {config.num_hidden_layers}-layer "
                             f"{config_json.get('model_type')}: "
                             f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise LayoutMismatch(f"tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies "
                                 f"{tuple(expected[name].shape)}")
    # copy: the result owns its memory (safetensors may hand out views of a file that is later rewritten)
    tensors = {name: t.to(device=device, dtype=None if name in stored_as_is else dtype, copy=True)
               for name, t in tensors.items() if name not in tied}
    model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _use_quantized_layers(model: torch.nn.Module, config_json: dict, tensors: dict[str, torch.Tensor],
                          dtype: torch.dtype) -> set[str]:
    """For a blockwise-FP8 checkpoint: its FP8 linear layers swapped in; the names of the tensors kept
    in their stored dtype (FP8 weights and their scales). Nothing for an unquantized checkpoint."""
    from miles_disagg.models.fp8 import scale_name, scheme_of
    from miles_disagg.models.fp8_linear import use_fp8_linears

    scheme = scheme_of(config_json)
    if scheme is None:
        return set()
    fp8_weights = {name for name, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
    without_scale = sorted(name for name in fp8_weights if scale_name(name) not in tensors)
    if without_scale:
        raise LayoutMismatch(f"FP8 weights without their weight_scale_inv: {without_scale[:3]}")
    use_fp8_linears(model, fp8_weights, scheme, dtype)
    return fp8_weights | {scale_name(name) for name in fp8_weights}


def load_dequantized(model_dir: Path, *, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The unquantized model holding the dequantized weights of a blockwise-FP8 checkpoint: they are
    written as a plain checkpoint into a temporary directory and loaded like any other (so every
    architecture and tensor-name convention is handled as for an unquantized checkpoint)."""
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file

    from miles_disagg.models.fp8 import dequantize_state, scheme_of

    config_json = read_config(model_dir)
    scheme = scheme_of(config_json, source=str(Path(model_dir) / "config.json"))
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(file))
    with tempfile.TemporaryDirectory(prefix="dequantized-") as scratch:
        plain = Path(scratch)
        for path in Path(model_dir).iterdir():
            if path.is_file() and path.suffix != ".safetensors" and not path.name.endswith(".index.json"):
                shutil.copy2(path, plain / path.name)
        (plain / "config.json").write_text(json.dumps({k: v for k, v in config_json.items()
                                                       if k != "quantization_config"}))
        save_file(dequantize_state(tensors, scheme, dtype), plain / "model.safetensors", metadata={"format": "pt"})
        del tensors
        return load_causal_lm(plain, dtype=dtype, device=device)
