"""The causal LM and a batched, left-padded KV cache that rows join and leave between steps.

The model is :func:`miles_disagg.models.causal_lm.load_causal_lm`'s: the native Qwen3 on CPU
where it applies, transformers otherwise. A :class:`KVBatch` holds the KV cache of the running
rows as one ``(keys, values)`` pair per layer, each ``[rows, kv_heads, length, head_dim]``,
left-padded, plus a ``[rows, length]`` attention mask (0 on padding) and each row's real length
(its next RoPE position).
Prefill builds a new ``KVBatch`` for the joining rows; :meth:`ModelRunner.merge` and
:meth:`ModelRunner.select` let rows join and leave without recomputing anything.

Mixture-of-experts models: every forward pass leaves the experts each new token was routed to in
:attr:`ModelRunner.last_routed` (int32 ``[rows, new_tokens, num_hidden_layers, top_k]``, -1 on
layers without experts; None for a dense model or a pass called with ``record_routing=False``),
read by the scheduler right after the call. A prefill asked to score rows' own tokens (SGLang's
input logprobs, ``logprob_start_len``) keeps the logits of those positions in the same pass and
leaves each row's :class:`InputScores` in :attr:`ModelRunner.last_input_scores` the same way.

Concurrency: a ``ModelRunner`` is used by exactly one thread (the scheduler's); weight
swaps happen on that thread between steps, so a forward pass never sees half-new weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch

from miles_disagg.engines.builtin.fused_experts import ExpertLayout
from miles_disagg.engines.builtin.routing import routing_capture
from miles_disagg.models.causal_lm import NATIVE, checkpoint_dtype, implementation, load_causal_lm, read_config
from miles_disagg.types import FormatError, InvalidInput, LayoutMismatch

# config.json keys that must agree for a checkpoint to be loadable into the live model
_ARCH_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim",
    # Qwen3-MoE: a different routing rule loads the same tensors but is another model
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers",
)


@dataclass
class KVBatch:
    """KV cache of the running rows (row ``i`` belongs to the scheduler's ``running[i]``)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values
    mask: torch.Tensor  # [rows, length] long, 0 on left padding
    positions: torch.Tensor  # [rows] long: real tokens in the cache = next position

    @property
    def num_rows(self) -> int:
        return int(self.mask.shape[0])

    def layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.layers


@dataclass(frozen=True)
class InputScoring:
    """What one row's prefill scores of its own tokens (SGLang's input logprobs)."""

    start: int
    """The first position reported (SGLang's ``logprob_start_len``, at most the row's length)."""
    top_k: int = 0
    """Also the ``top_k`` most likely tokens at each position (SGLang's ``top_logprobs_num``)."""
    token_ids: tuple[int, ...] | None = None
    """Also these ids' logprobs at each position (SGLang's ``token_ids_logprob``)."""
    positions: tuple[tuple[int, ...], ...] | None = None
    """Or each position's own ids, entry ``j`` for position ``start + j`` (``token_ids_logprob_positions``)."""


@dataclass(frozen=True)
class InputScores:
    """SGLang's input logprobs of one row, one entry per token from ``start`` on, under
    ``log_softmax(logits)`` (no temperature: SGLang scores input tokens with the raw logits). The
    first entry is None (SGLang never reports the token at ``start``, even past position 0)."""

    token_logprobs: list[float | None]
    top_logprobs: list[list[tuple[float, int]] | None] | None = None
    """With ``top_k``: ``(logprob, token_id)`` pairs, most likely first (the first entry None)."""
    token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None
    """With ``token_ids`` or ``positions``: ``(logprob, token_id)`` of the ids asked, in their order (the
    first entry None, and so is a position asked for no id)."""


def input_scores(row_logits: torch.Tensor, tokens: list[int], scoring: InputScoring) -> InputScores:
    """One row's :class:`InputScores` from its last ``K`` positions' logits ``[K, vocab]`` (``K``
    at least ``len(tokens) - start``): the logits at position ``p`` score the token at ``p + 1``."""
    n, start = len(tokens), scoring.start
    wants_ids = scoring.token_ids is not None or scoring.positions is not None
    if start >= n:
        return InputScores([], [] if scoring.top_k else None, [] if wants_ids else None)
    first = row_logits.shape[0] - n + start  # the kept index of position ``start``
    logprobs = torch.log_softmax(row_logits[first:row_logits.shape[0] - 1].float(), dim=-1)  # positions start..n-2
    targets = torch.tensor(tokens[start + 1:], dtype=torch.long, device=logprobs.device)
    values = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    top = None
    if scoring.top_k:
        best, ids = torch.topk(logprobs, min(scoring.top_k, logprobs.shape[-1]), dim=-1)
        top = [None] + [list(zip(v, i)) for v, i in zip(best.tolist(), ids.tolist())]
    return InputScores([None] + values, top, _ids_logprobs(logprobs, scoring) if wants_ids else None)


def _ids_logprobs(logprobs: torch.Tensor, scoring: InputScoring) -> list[list[tuple[float, int]] | None]:
    """Rows ``[positions start+1 .., vocab]``: the asked ids' logprobs, one list per position (first None)."""
    if scoring.token_ids is not None:
        ids = list(scoring.token_ids)
        values = logprobs[:, ids].tolist() if ids else [[] for _ in range(logprobs.shape[0])]
        return [None] + [list(zip(row, ids)) for row in values]
    rows: list[list[tuple[float, int]] | None] = [None]
    for j, ids in enumerate(scoring.positions[1:]):
        rows.append(list(zip(logprobs[j, list(ids)].tolist(), ids)) if ids else None)
    return rows


def resolve_dtype(name: str, model_dir: Path) -> torch.dtype:
    """``auto`` takes the checkpoint's ``torch_dtype``/``dtype`` (float32 when absent)."""
    if name != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    return checkpoint_dtype(model_dir)


class ModelRunner:
    """One causal LM on one device: batched prefill/decode and weight swaps."""

    def __init__(self, model_dir: Path, *, device: str = "cpu", dtype: str = "auto"):
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.model_dir)
        self.config_json = read_config(self.model_dir)
        self.implementation = implementation(self.model_dir, self.device)[0]
        model = load_causal_lm(self.model_dir, dtype=self.dtype, device=self.device)
        self.model = model.requires_grad_(False)
        self._forward = _native_forward if self.implementation == NATIVE else _transformers_forward(self.model)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_context = int(self.config_json.get("max_position_embeddings") or 4096)
        self.params = dict(self.model.named_parameters(remove_duplicate=False))
        self.experts = ExpertLayout(self.params)  # transformers' fused experts under their on-disk names
        self.routing = routing_capture(self.model, self.config_json, self.implementation)
        self.last_routed: torch.Tensor | None = None
        self.last_input_scores: list[InputScores | None] | None = None

    @property
    def quantization(self) -> str | None:
        """``fp8`` for a blockwise-FP8 checkpoint (SGLang's name for it), else None."""
        quant = self.config_json.get("quantization_config")
        return quant.get("quant_method") if isinstance(quant, dict) else None

    @property
    def is_moe(self) -> bool:
        return self.routing is not None

    def eos_token_ids(self) -> set[int]:
        """``eos_token_id`` of config.json and generation_config.json (an id or a list each)."""
        ids: set[int] = set()
        generation = self.model_dir / "generation_config.json"
        sources = [self.config_json] + ([json.loads(generation.read_text())] if generation.is_file() else [])
        for source in sources:
            value = source.get("eos_token_id")
            ids.update([value] if isinstance(value, int) else list(value or []))
        return ids

    # ------------------------------------------------------------------ forward passes

    @torch.inference_mode()
    def prefill(self, token_lists: list[list[int]], record_routing: bool = False,
                scoring: Sequence[InputScoring | None] | None = None) -> tuple[torch.Tensor, KVBatch]:
        """Run the rows' tokens from scratch; return last-position float32 logits and their KV.

        ``scoring``: per row, the prompt positions to score (None: none); the same pass keeps those
        positions' logits and leaves each row's :class:`InputScores` in :attr:`last_input_scores`."""
        length = max(len(t) for t in token_lists)
        ids = torch.zeros((len(token_lists), length), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, tokens in enumerate(token_lists):
            ids[row, length - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
            mask[row, length - len(tokens):] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        keep = max([len(t) - s.start for t, s in zip(token_lists, scoring or []) if s is not None] + [1])
        logits, layers = self._routed_forward(ids.to(self.device), mask.to(self.device),
                                              position_ids.to(self.device), None, keep, record_routing)
        self.last_input_scores = None
        if scoring is not None:
            self.last_input_scores = [None if s is None else input_scores(logits[row], tokens, s)
                                      for row, (tokens, s) in enumerate(zip(token_lists, scoring, strict=True))]
        positions = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
        return logits[:, -1, :].float(), KVBatch(layers=layers, mask=mask, positions=positions)

    @torch.inference_mode()
    def extend(self, past: Layers, tokens: list[int]) -> tuple[torch.Tensor, KVBatch]:
        """One row whose first ``P`` tokens' KV is ``past`` (per layer ``[1, kv_heads, P, head_dim]``,
        from the prefix cache): run only ``tokens`` (the rest of its prompt) at positions ``P..``;
        return the last position's float32 logits ``[1, vocab]`` and the row's whole KV."""
        cached = int(past[0][0].shape[2])
        total = cached + len(tokens)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        mask = torch.ones((1, total), dtype=torch.long)
        positions = torch.arange(cached, total, dtype=torch.long, device=self.device)[None]
        logits, layers = self._routed_forward(ids, mask.to(self.device), positions, past, 1, False)
        return logits[:, -1, :].float(), KVBatch(layers=layers, mask=mask, positions=torch.tensor([total]))

    def row_layers(self, batch: KVBatch, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row ``row``'s KV, per layer ``[kv_heads, tokens, head_dim]`` (views; rows are right-aligned,
        so its real tokens are the last ``positions[row]`` columns)."""
        length = int(batch.positions[row])
        return [(k[row, :, k.shape[2] - length:], v[row, :, v.shape[2] - length:]) for k, v in batch.layer_tensors()]

    @torch.inference_mode()
    def decode(self, batch: KVBatch, next_tokens: list[int], record_routing: bool = False) -> torch.Tensor:
        """Feed one token per row; the cache grows in place; return float32 logits ``[rows, vocab]``."""
        ids = torch.tensor(next_tokens, dtype=torch.long).unsqueeze(1)
        batch.mask = torch.cat([batch.mask, torch.ones((batch.num_rows, 1), dtype=torch.long)], dim=1)
        logits, batch.layers = self._routed_forward(ids.to(self.device), batch.mask.to(self.device),
                                                    batch.positions.unsqueeze(1).to(self.device), batch.layers, 0,
                                                    record_routing)
        batch.positions = batch.positions + 1
        return logits[:, -1, :].float()

    def _routed_forward(self, ids, mask, positions, layers, logits_to_keep, record: bool):
        self.last_routed = None
        if self.routing is None or not record:
            return self._forward(self.model, ids, mask, positions, layers, logits_to_keep)
        with self.routing.capturing(ids.shape) as captured:
            out = self._forward(self.model, ids, mask, positions, layers, logits_to_keep)
        self.last_routed = captured.result()
        return out

    @torch.inference_mode()
    def full_routed_experts(self, tokens: list[int]) -> torch.Tensor:
        """Reference: the experts of every position of one unbatched forward pass (tests use it)."""
        ids = torch.tensor([tokens], device=self.device)
        self._routed_forward(ids, torch.ones_like(ids), torch.arange(len(tokens), device=self.device)[None], None, 1,
                             True)
        return self.last_routed[0]

    @torch.inference_mode()
    def full_logprobs(self, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
        """Reference: ``log_softmax(logits / T)`` of one unbatched forward pass (tests use it)."""
        out = self.model(input_ids=torch.tensor([tokens], device=self.device))
        return torch.log_softmax(out.logits[0].float() / temperature, dim=-1)

    # ------------------------------------------------------------------ batch surgery

    def merge(self, a: KVBatch | None, b: KVBatch) -> KVBatch:
        """Rows of ``a`` then rows of ``b`` in one batch (the shorter side is left-padded)."""
        if a is None or a.num_rows == 0:
            return b
        length = max(a.mask.shape[1], b.mask.shape[1])
        layers = [
            (torch.cat([_left_pad(ka, length), _left_pad(kb, length)]), torch.cat([_left_pad(va, length), _left_pad(vb, length)]))
            for (ka, va), (kb, vb) in zip(a.layer_tensors(), b.layer_tensors())
        ]
        mask = torch.cat([_left_pad(a.mask, length), _left_pad(b.mask, length)])
        return KVBatch(layers, mask, torch.cat([a.positions, b.positions]))

    def select(self, batch: KVBatch, keep: list[int]) -> KVBatch | None:
        """Only the rows ``keep`` (in that order); columns that became all-padding are dropped."""
        if not keep:
            return None
        if keep == list(range(batch.num_rows)):
            return batch
        index = torch.tensor(keep, dtype=torch.long)
        mask = batch.mask.index_select(0, index)
        start = int((mask.sum(0) > 0).nonzero()[0]) if mask.any() else 0
        dev_index = index.to(self.device)
        layers = [
            (k.index_select(0, dev_index)[:, :, start:], v.index_select(0, dev_index)[:, :, start:])
            for k, v in batch.layer_tensors()
        ]
        return KVBatch(layers, mask[:, start:], batch.positions.index_select(0, index))

    # ------------------------------------------------------------------ weights

    def check_compatible(self, model_dir: Path) -> None:
        """``InvalidInput`` unless ``model_dir`` holds a checkpoint of the live architecture."""
        other = read_config(Path(model_dir))
        for key in _ARCH_KEYS:
            if key in self.config_json and other.get(key) != self.config_json.get(key):
                raise InvalidInput(
                    f"model_path {str(model_dir)!r} holds a different architecture: "
                    f"{key}={other.get(key)!r}, the live model has {self.config_json.get(key)!r}"
                )

    def load_tensors(self, model_dir: Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Read ``names`` (all parameters when ``None``) from a checkpoint's safetensors, checked
        against the live layout and converted to the live dtype/device. Nothing live changes."""
        from safetensors import safe_open

        live = self.named_weights()
        wanted = set(live) if names is None else set(names)
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise InvalidInput(f"no *.safetensors files in {str(model_dir)!r}")
        loaded: dict[str, torch.Tensor] = {}
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():
                        if name in wanted:
                            loaded[name] = self._converted(name, handle.get_tensor(name), live)
            except (LayoutMismatch, InvalidInput):
                raise
            except Exception as exc:  # truncated or corrupt file: the caller's input, not our fault
                raise FormatError(f"cannot read {str(file)!r}: {type(exc).__name__}: {exc}") from exc
        missing = wanted - set(loaded) - self._tied_names()
        if missing:
            raise LayoutMismatch(f"checkpoint {str(model_dir)!r} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        return loaded

    def _converted(self, name: str, tensor: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        live = weights.get(name)
        if live is None:
            raise LayoutMismatch(f"tensor {name!r} is not a parameter of the live model")
        if tuple(tensor.shape) != tuple(live.shape):
            raise LayoutMismatch(f"tensor {name!r} has shape {tuple(tensor.shape)}, the live model {tuple(live.shape)}")
        # copy=True: the result must own its memory; safetensors may hand out views of an mmap of
        # a checkpoint file that the materializer later rewrites.
        return tensor.to(device=self.device, dtype=live.dtype, copy=True).contiguous()

    def _tied_names(self) -> set[str]:
        seen: dict[int, str] = {}
        tied = set()
        for name, param in self.params.items():
            if id(param) in seen:
                tied.add(name)
            seen.setdefault(id(param), name)
        return tied

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The live weights by their checkpoint names (what versions, checksums and updates name)."""
        return self.experts.named_weights(self.params)

    def live_names(self, names: Iterable[str]) -> set[str]:
        """The parameters an update of ``names`` (checkpoint names) fills in full."""
        return self.experts.live_names(names)

    def swap_in(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Make ``tensors`` (by checkpoint name) live by pointer swap (``param.data = t``): O(1) per
        tensor; a fused expert parameter is rebuilt first (:mod:`.fused_experts`).

        Returns the tensors they displaced, still allocated: freeing hundreds of megabytes (returning
        the pages to the OS) takes tens of milliseconds, so the caller drops them after the swap,
        off the scheduler thread, where it costs no pause."""
        return self.experts.swap_in(self.params, tensors)


def _left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad dim 2 (KV ``[b, h, L, d]``) or dim 1 (mask ``[b, L]``) with zeros to ``length``."""
    dim = 2 if tensor.dim() == 4 else 1
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


Layers = list[tuple[torch.Tensor, torch.Tensor]]


def _native_forward(model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                    layers: Layers | None, logits_to_keep: int) -> tuple[torch.Tensor, Layers]:
    out = model(ids, attention_mask=mask, position_ids=positions, cache=layers, logits_to_keep=logits_to_keep)
    return out.logits, out.cache


def _transformers_forward(model):
    """The same call for a transformers model: its ``DynamicCache`` built from, and read back into,
    per-layer tensors."""
    cache_arg = _cache_argument(model)

    def forward(model, ids, mask, positions, layers: Layers | None, logits_to_keep: int):
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config) if layers is None else \
            DynamicCache(ddp_cache_data=list(layers), config=model.config)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    logits_to_keep=logits_to_keep, **{cache_arg: cache})
        returned = getattr(out, "cache", None) or out.past_key_values
        return out.logits, [(layer.keys, layer.values) for layer in returned.layers]

    return forward


def _cache_argument(model) -> str:
    """The forward argument that takes the KV cache: ``cache`` in newer transformers 5 releases,
    ``past_key_values`` before (passing the wrong one is silently ignored: no cache at all)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
