"""LoRA on the FSDP backend's policy (miles' ``--lora-rank`` group): PEFT's adapter layers injected
into the model in place, the base frozen, and the two forms the adapter leaves the trainer in.

* The adapter in PEFT's saved form (:func:`adapter_state`, :func:`adapter_config`): the tensor
  names of ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight``) and the
  ``adapter_config.json`` fields PEFT and SGLang read (``r``, ``lora_alpha``, ``target_modules``).
* The policy the engines serve as full weights (:func:`policy_tensors`): each targeted weight
  merged from the frozen base and the current adapter (``W + alpha / r * B @ A``) every time, never
  merged into the base in place, so an adapter is never applied twice (miles #1087); with
  ``--lora-train-only`` the base weights unchanged.

The adapter is initialised from ``--seed`` alone (the same on every rank) and warm-started from
``--lora-adapter-path`` when given, which must match ``--lora-rank``, ``--lora-alpha`` and the
targets. Adapters on MoE experts are not covered: MLP targets on a model with sparse layers are
refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from miles_disagg.config.lora_rules import MLP_MODULES, resolve_targets
from miles_disagg.config.training import TrainConfig
from miles_disagg.types import ConfigError

ADAPTER_NAME = "default"
PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before each module's name
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: int
    dropout: float
    targets: tuple[str, ...]

    @classmethod
    def of(cls, config: TrainConfig) -> "LoraSettings":
        return cls(config.lora_rank, config.lora_alpha, config.lora_dropout,
                   resolve_targets(config.target_modules, config.exclude_modules))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.targets), bias="none")


def adapter_config(settings: LoraSettings, base_model: str | None = None) -> dict:
    """``adapter_config.json`` as PEFT writes it (the fields PEFT's and SGLang's loaders read)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank, "lora_alpha": settings.alpha,
            "lora_dropout": settings.dropout, "target_modules": list(settings.targets), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "base_model_name_or_path": base_model, "inference_mode": True}


def attach_adapter(model: torch.nn.Module, settings: LoraSettings, seed: int) -> None:
    """Inject the adapter into ``model`` in place; only the adapter's parameters stay trainable."""
    from peft import inject_adapter_in_model

    _check_covered(model, settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # every rank draws the same lora_A
        inject_adapter_in_model(settings.peft_config(), model, adapter_name=ADAPTER_NAME)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".lora_" in name)
    found = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    missing = [t for t in settings.targets if t not in found]
    if missing:
        raise ConfigError(f"--target-modules {missing}: the model has no such projection", ("--target-modules",))


def _check_covered(model: torch.nn.Module, settings: LoraSettings) -> None:
    has_experts = any(name.endswith(".experts") for name, _ in model.named_modules())
    on_mlp = [t for t in settings.targets if t in MLP_MODULES]
    if has_experts and on_mlp:
        raise ConfigError(f"LoRA on {on_mlp} of a mixture-of-experts model would put adapters on its experts, "
                          "which no engine here serves: use --target-modules attn (or --exclude-modules mlp)",
                          ("--target-modules", "--exclude-modules"))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # FSDP2 DTensor (collective)


@torch.no_grad()
def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter as CPU float32 tensors under PEFT's saved names (collective under FSDP2)."""
    state = {}
    for name, tensor in model.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            saved = name.replace(f".{ADAPTER_NAME}.", ".")
            state[PEFT_PREFIX + saved] = _full(tensor).detach().to("cpu", torch.float32, copy=True)
    return state


@torch.no_grad()
def policy_tensors(model: torch.nn.Module, merge: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight under its name before injection: targeted ones merged with the adapter
    (``merge``) or the frozen base's (collective under FSDP2)."""
    for name, tensor in model.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if ".base_layer." not in name:
            yield name, _full(tensor)
            continue
        path = name.rsplit(".base_layer.", 1)[0]
        weight = _full(tensor)
        if merge:
            layer = model.get_submodule(path)
            b, a = _full(layer.lora_B[ADAPTER_NAME].weight), _full(layer.lora_A[ADAPTER_NAME].weight)
            weight = (weight.float() + layer.scaling[ADAPTER_NAME] * (b.float() @ a.float())).to(weight.dtype)
        yield name.replace(".base_layer.", "."), weight


def load_adapter(model: torch.nn.Module, path: str, settings: LoraSettings) -> None:
    """Warm start from a PEFT adapter directory; ``ConfigError`` naming ``--lora-adapter-path`` when it
    does not match the flags or the model."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    flag_name = "--lora-adapter-path"
    directory = Path(path)
    try:
        saved = json.loads((directory / ADAPTER_CONFIG).read_text())
        tensors = load_file(str(directory / ADAPTER_WEIGHTS))
    except (OSError, ValueError) as error:
        raise ConfigError(f"{flag_name} {path!r}: not a readable PEFT adapter ({error})", (flag_name,)) from None
    wanted = {"r": settings.rank, "lora_alpha": settings.alpha, "target_modules": sorted(settings.targets)}
    found = {"r": saved.get("r"), "lora_alpha": saved.get("lora_alpha"),
             "target_modules": sorted(saved.get("target_modules") or [])}
    if found != wanted:
        raise ConfigError(f"{flag_name} {path!r} holds an adapter with {found}, and the flags ask for {wanted}: "
                          "give the adapter's --lora-rank, --lora-alpha and --target-modules", (flag_name,))
    expected = set(adapter_state(model))
    if set(tensors) != expected:
        raise ConfigError(f"{flag_name} {path!r}: its tensors are not this model's adapter "
                          f"({len(set(tensors) - expected)} unknown, {len(expected - set(tensors))} missing)",
                          (flag_name,))
    state = {name.removeprefix(PEFT_PREFIX): tensor for name, tensor in tensors.items()}
    set_peft_model_state_dict(model, state, adapter_name=ADAPTER_NAME)
