"""Blockwise FP8 (the format SGLang loads for ``quant_method: fp8`` with ``weight_block_size``): one rule
shared by the offline converter (``miles-disagg convert-fp8``), the publisher (every version of a run
served in FP8) and the built-in engine (which dequantizes it).

Per 2-D linear weight ``W`` (``[out, in]``) and block ``[bo, bi]`` (default 128 x 128):

- ``weight``: ``float8_e4m3fn``, ``W / s`` of its block, rounded to nearest (ties to even) and clamped
  to +-448 (the format's largest finite value);
- ``weight_scale_inv``: ``float32`` ``[ceil(out / bo), ceil(in / bi)]``, ``s = max|W| / 448`` over the
  block (edge blocks are the partial ones), the block max clamped to at least :data:`MIN_BLOCK_MAX` so
  an all-zero block has a finite scale. ``W ~= weight * weight_scale_inv`` blockwise.

Everything is computed in float32 on the CPU, so the same BF16 weights give the same bytes whatever
produced them (the converter, any trainer rank, any device). Embeddings, ``lm_head``, norms and the MoE
router gate keep their dtype. Pure tensor code: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

from miles_disagg.types import ConfigError, FormatError

FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value."""
MIN_BLOCK_MAX = 1e-12
"""A block's max is clamped to at least this before dividing (an all-zero block)."""
SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)
KEEP_DTYPE_MARKERS = ("embed_tokens", "lm_head", "norm", ".mlp.gate.", "shared_expert_gate")
"""Names containing one of these stay in their dtype (embeddings, output head, norms, router gates)."""
QUANTIZATION_CONFIG_FLAG = "--hf-checkpoint"


@dataclass(frozen=True)
class BlockFp8:
    """The blockwise FP8 scheme of a checkpoint (its ``config.json`` ``quantization_config``)."""

    block: tuple[int, int] = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if len(self.block) != 2 or any(not isinstance(b, int) or b < 1 for b in self.block):
            raise ValueError(f"the FP8 block size must be two integers >= 1, got {self.block!r}")

    def quantization_config(self) -> dict[str, Any]:
        """What ``config.json`` carries so SGLang (and this project's engine) loads the checkpoint as FP8."""
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block)}


def scheme_of(config: Mapping[str, Any], *, source: str = "config.json") -> BlockFp8 | None:
    """The FP8 scheme a model config declares; ``None`` for an unquantized model. Any other
    quantization is refused with a ``ConfigError`` naming it (this project serves blockwise FP8 only)."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, Mapping):
        raise FormatError(f"{source}: quantization_config must be an object, got {type(quant).__name__}")
    method = quant.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"{source}: quantization_config.quant_method {method!r} is not supported; this project "
                          f"serves unquantized and blockwise FP8 checkpoints (miles-disagg convert-fp8 makes one)",
                          flags=(QUANTIZATION_CONFIG_FLAG,))
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{source}: FP8 format {quant.get('fmt')!r} is not supported (only e4m3)",
                          flags=(QUANTIZATION_CONFIG_FLAG,))
    block = quant.get("weight_block_size")
    if block is None:
        raise ConfigError(f"{source}: per-tensor FP8 (no weight_block_size) is not supported; convert the BF16 "
                          f"checkpoint with miles-disagg convert-fp8 (blockwise)", flags=(QUANTIZATION_CONFIG_FLAG,))
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b >= 1 for b in block)):
        raise FormatError(f"{source}: weight_block_size must be two integers >= 1, got {block!r}")
    return BlockFp8(tuple(block))


def is_quantized_weight(name: str, shape: Iterable[int]) -> bool:
    """Whether the scheme stores tensor ``name`` of ``shape`` as FP8 (2-D linear weights only)."""
    return (name.endswith(".weight") and len(tuple(shape)) == 2
            and not any(marker in name for marker in KEEP_DTYPE_MARKERS))


def scale_name(weight_name: str) -> str:
    """``...proj.weight`` -> ``...proj.weight_scale_inv``."""
    return weight_name + SCALE_SUFFIX


def weight_name_of_scale(name: str) -> str | None:
    """The weight a ``..._scale_inv`` tensor scales, or ``None`` for any other name."""
    return name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def _padded_blocks(weight: Any, block: tuple[int, int]) -> Any:
    """float32 ``[rows_b, bo, cols_b, bi]`` view of ``weight`` zero-padded to whole blocks."""
    import torch

    rows, cols = weight.shape
    nr, nc = scale_shape((rows, cols), block)
    padded = torch.zeros((nr * block[0], nc * block[1]), dtype=torch.float32)
    padded[:rows, :cols] = weight.detach().to(device="cpu", dtype=torch.float32)
    return padded.view(nr, block[0], nc, block[1])


def quantize(weight: Any, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[Any, Any]:
    """``(float8_e4m3fn weight, float32 weight_scale_inv)`` of a 2-D tensor (any float dtype, any
    device; the result is on the CPU). Deterministic: the bytes depend only on the values."""
    import torch

    if weight.dim() != 2:
        raise ValueError(f"blockwise FP8 quantizes 2-D weights, got shape {tuple(weight.shape)}")
    blocks = _padded_blocks(weight, block)
    block_max = blocks.abs().amax(dim=(1, 3)).clamp_min(MIN_BLOCK_MAX)
    scale = block_max / FP8_MAX
    scaled = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    rows, cols = weight.shape
    q = scaled.reshape(blocks.shape[0] * block[0], -1)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def dequantize(q: Any, scale_inv: Any, block: tuple[int, int] = DEFAULT_BLOCK, dtype: Any = None) -> Any:
    """``q * weight_scale_inv`` blockwise, as float32 (or ``dtype``). Shapes are checked: a scale tensor
    that does not cover the weight's blocks is a ``FormatError``."""
    import torch

    rows, cols = q.shape
    want = scale_shape((rows, cols), block)
    if tuple(scale_inv.shape) != want:
        raise FormatError(f"FP8 scale shape {tuple(scale_inv.shape)} does not cover weight {tuple(q.shape)} "
                          f"in {block[0]}x{block[1]} blocks (expected {want})")
    expanded = scale_inv.to(torch.float32).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    out = q.to(torch.float32) * expanded[:rows, :cols]
    return out if dtype is None else out.to(dtype)


def quantize_named(named: Iterable[tuple[str, Any]], scheme: BlockFp8,
                   fp8_names: frozenset[str] | None = None) -> Iterator[tuple[str, Any]]:
    """The served (FP8) form of ``(name, tensor)`` pairs: each quantized weight becomes its FP8 weight
    followed by its scale; every other tensor passes unchanged. ``fp8_names``: the weights the target
    layout stores as FP8 (default: the naming rule, :func:`is_quantized_weight`)."""
    for name, tensor in named:
        quantized = name in fp8_names if fp8_names is not None else is_quantized_weight(name, tensor.shape)
        if not quantized:
            yield name, tensor
            continue
        q, scale = quantize(tensor, scheme.block)
        yield name, q
        yield scale_name(name), scale


def dequantize_state(state: Mapping[str, Any], scheme: BlockFp8, dtype: Any) -> dict[str, Any]:
    """A full-precision state dict from a served FP8 one (scales folded into their weights)."""
    out = {}
    for name, tensor in state.items():
        if weight_name_of_scale(name) is not None:
            continue
        scale = state.get(scale_name(name))
        out[name] = tensor if scale is None else dequantize(tensor, scale, scheme.block, dtype)
    missing = [n for n in state if weight_name_of_scale(n) is not None and weight_name_of_scale(n) not in state]
    if missing:
        raise FormatError(f"FP8 scales without their weights: {sorted(missing)[:5]}")
    return out
