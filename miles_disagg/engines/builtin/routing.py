"""Which experts a forward pass routed each token to, for ``return_routed_experts``.

Forward hooks on each sparse layer record its top-k expert indices: on the native Qwen3-MoE
(:class:`miles_disagg.models.qwen3_moe.SparseMoeBlock`, whose output carries them) and on
transformers' ``Qwen3MoeForCausalLM`` (its router ``mlp.gate`` returns ``(logits, weights,
indices)``), so the engine records routing on CPU and CUDA alike without a second forward pass.
Hooks record only inside :meth:`RoutingCapture.capturing`; the result is SGLang's layout per token,
int32 ``[rows, new_tokens, num_hidden_layers, top_k]`` on the CPU, -1 on layers without experts.
The model runner records only for forward passes whose rows asked for it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from miles_disagg.models.causal_lm import NATIVE


class Captured:
    """The routing of one forward pass over ``shape`` = ``(rows, new_tokens)``."""

    def __init__(self, shape: tuple[int, int], layers: int, top_k: int):
        self.size = (*shape, layers, top_k)
        self.tensor: torch.Tensor | None = None  # on the model's device until result()
        self.seen: set[int] = set()

    def record(self, layer: int, indices: torch.Tensor) -> None:
        if self.tensor is None:
            self.tensor = torch.full(self.size, -1, dtype=torch.int32, device=indices.device)
        self.tensor[:, :, layer] = indices.reshape(*self.size[:2], -1).to(torch.int32)
        self.seen.add(layer)

    def result(self) -> torch.Tensor:
        """On the CPU (one copy per forward pass, not one per layer)."""
        return self.tensor.cpu() if self.tensor is not None else torch.full(self.size, -1, dtype=torch.int32)


class RoutingCapture:
    """Hooks on the sparse layers of one model; see the module docstring."""

    def __init__(self, modules: dict[int, torch.nn.Module], pick: Callable, layers: int, top_k: int):
        self.layers, self.top_k = layers, top_k
        self.sparse_layers = sorted(modules)
        self._current: Captured | None = None
        for index, module in modules.items():
            module.register_forward_hook(self._hook(index, pick))

    def _hook(self, index: int, pick: Callable):
        def hook(_module, _inputs, output):
            if self._current is not None:
                self._current.record(index, pick(output))
        return hook

    @contextlib.contextmanager
    def capturing(self, shape: tuple[int, ...]) -> Iterator[Captured]:
        captured = Captured((int(shape[0]), int(shape[1])), self.layers, self.top_k)
        self._current = captured
        try:
            yield captured
        finally:
            self._current = None
        missing = set(self.sparse_layers) - captured.seen
        if missing:
            raise RuntimeError(f"routing of sparse layers {sorted(missing)} was not recorded")


def routing_capture(model: torch.nn.Module, config_json: dict, implementation: str) -> RoutingCapture | None:
    """Hooks for a Qwen3-MoE with experts; None for any other model."""
    from miles_disagg.models.qwen3_moe import Qwen3MoeConfig, is_moe_config

    if not is_moe_config(config_json):
        return None
    config = Qwen3MoeConfig.from_dict(config_json)
    if not config.sparse_layers:
        return None
    layers = model.model.layers
    if implementation == NATIVE:
        modules = {i: layers[i].mlp for i in config.sparse_layers}
        pick = _native_experts
    else:
        modules = {i: layers[i].mlp.gate for i in config.sparse_layers}
        pick = _transformers_router_indices
    return RoutingCapture(modules, pick, config.num_hidden_layers, config.num_experts_per_tok)


def _native_experts(output) -> torch.Tensor:
    return output[1]  # SparseMoeBlock: (hidden, experts used [rows, length, top_k], own top-k)


def _transformers_router_indices(output) -> torch.Tensor:
    return output[-1]  # Qwen3MoeTopKRouter: (logits, weights, indices [tokens, top_k])
