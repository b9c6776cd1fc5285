"""Make small Qwen3 checkpoints on the spot (random weights, character-level tokenizer).

Nothing is downloaded: the tokenizer is built with the ``tokenizers`` library from a
fixed character set, the model from a ``Qwen3Config`` with a fixed seed. The result is
an ordinary HF checkpoint directory (``config.json``, ``model.safetensors``,
tokenizer files) that transformers, the built-in engine and the trainer all load, plus
``miles_disagg_init.json``: the arguments it was made with (seed, charset, shape, dtype), so a
run can tell whether an existing directory is the model its flags ask for.
"""

from __future__ import annotations

import inspect
import json
import string
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHARSET = string.digits + string.ascii_letters + string.punctuation + " \n"
DIGITS_CHARSET = string.digits + "+-=:, \n"
"""A small vocabulary for arithmetic-style tasks: a random policy hits a digit often enough to learn from."""
CHARSETS = {"full": CHARSET, "digits": DIGITS_CHARSET}
INIT_RECORD_FILENAME = "miles_disagg_init.json"


def build_tokenizer(charset: str = CHARSET):
    """A character-level fast tokenizer: one token per character of ``charset``, three special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in charset:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )


def make_tiny_qwen3(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    vocab_size: int | None = None,
    max_position_embeddings: int = 2048,
    dtype: str = "float32",
    seed: int = 0,
    charset: str = CHARSET,
    num_experts: int = 0,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
) -> Path:
    """Write a random tiny Qwen3 checkpoint with its tokenizer into ``out_dir``; return the path.

    ``num_experts`` > 0 makes a Qwen3-MoE (``Qwen3MoeForCausalLM``: every layer sparse, top
    ``num_experts_per_tok`` of ``num_experts`` experts of width ``moe_intermediate_size``, default
    ``intermediate_size // 2``, renormalised top-k weights); 0 makes the dense Qwen3.
    ``vocab_size`` defaults to the tokenizer's size rounded up to a multiple of 8;
    ``charset`` is the tokenizer's character set (``CHARSETS`` names two). The arguments are
    recorded in ``INIT_RECORD_FILENAME`` (``read_init_record``).
    """
    spec = {name: value for name, value in locals().items() if name != "out_dir"}
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(charset)
    vocab_size = vocab_size or _round_up(len(tokenizer), 8)
    config = _config_class(num_experts)(
        **_moe_fields(num_experts, num_experts_per_tok, moe_intermediate_size or intermediate_size // 2),
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    if num_experts:
        _name_experts_as_released_checkpoints_do(out / "config.json")
    tokenizer.save_pretrained(out)
    (out / INIT_RECORD_FILENAME).write_text(json.dumps({"made_by": __name__, "spec": spec}, indent=2) + "\n")
    return out


def _config_class(num_experts: int):
    from transformers import Qwen3Config, Qwen3MoeConfig

    return Qwen3MoeConfig if num_experts else Qwen3Config


def _moe_fields(num_experts: int, top_k: int, width: int) -> dict[str, Any]:
    if not num_experts:
        return {}
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
    return {"num_experts": num_experts, "num_experts_per_tok": top_k, "moe_intermediate_size": width,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _name_experts_as_released_checkpoints_do(path: Path) -> None:
    """transformers 5 saves ``num_experts`` under its alias ``num_local_experts``; released
    Qwen3-MoE checkpoints (and SGLang, Megatron converters) use ``num_experts``."""
    config = json.loads(path.read_text())
    config["num_experts"] = config.pop("num_local_experts", config.get("num_experts"))
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


MOE_SPEC_DEFAULTS = {"num_experts": 0, "num_experts_per_tok": 2, "moe_intermediate_size": None}
"""What a record written before MoE checkpoints existed means by its absent keys (a dense model)."""


def tiny_spec(**overrides: Any) -> dict[str, Any]:
    """The arguments ``make_tiny_qwen3`` records for a call with ``overrides`` (defaults elsewhere)."""
    params = inspect.signature(make_tiny_qwen3).parameters
    spec = {name: p.default for name, p in params.items() if name != "out_dir"}
    unknown = set(overrides) - set(spec)
    if unknown:
        raise TypeError(f"make_tiny_qwen3 has no argument(s) {sorted(unknown)}")
    return {**spec, **overrides}


def read_init_record(directory: str | Path) -> dict[str, Any] | None:
    """The arguments a checkpoint directory was made with by ``make_tiny_qwen3`` (None if it was not)."""
    path = Path(directory) / INIT_RECORD_FILENAME
    if not path.is_file():
        return None
    try:
        return {**MOE_SPEC_DEFAULTS, **json.loads(path.read_text())["spec"]}
    except (ValueError, KeyError, TypeError):
        return None


def charset_name(charset: str) -> str:
    """The ``CHARSETS`` name of a character set (``custom`` for any other)."""
    return next((name for name, chars in CHARSETS.items() if chars == charset), "custom")


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple
