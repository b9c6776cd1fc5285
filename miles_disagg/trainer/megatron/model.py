"""Parallel state, the megatron-core ``GPTModel`` of an HF Qwen3 config, and loading HF weights into it.

Call order inside a trainer rank (``torch.distributed`` already initialized):
``init_parallel_state`` -> ``build_gpt`` -> ``load_hf_weights``. On CPU the model is
float32 with megatron's local (non Transformer Engine) layers; on GPU it is bfloat16 and
uses Transformer Engine layers when ``transformer_engine`` is importable (context
parallelism needs them).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from miles_disagg.config.training import TrainConfig
from miles_disagg.trainer.megatron.convert import ModelShape, ParamRule, param_rules, stage_layers, to_megatron
from miles_disagg.types import ConfigError


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the TP x CP x DP x PP grid (megatron's order: TP fastest)."""

    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    cp_size: int
    cp_rank: int
    dp_size: int
    dp_rank: int
    ep_size: int = 1  # expert parallelism: experts split over EP ranks (MoE layers only)
    ep_rank: int = 0
    expert_dp_rank: int = 0  # this rank's place among the replicas of its experts

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def import_megatron() -> None:
    """Import megatron-core quietly (it warns about every optional accelerator library it lacks);
    ``ConfigError`` when it is not installed."""
    from miles_disagg.trainer.megatron.cpu_patches import fusions_left_uncompiled

    try:
        with warnings.catch_warnings(), fusions_left_uncompiled():
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state, tensor_parallel  # noqa: F401
            from megatron.core.models.gpt import GPTModel  # noqa: F401
            from megatron.core.models.gpt import gpt_layer_specs  # noqa: F401
            from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"--train-backend megatron needs megatron-core ({exc}); "
                          "install it with `pip install 'miles-disagg[megatron]'`", ("--train-backend",)) from None


def has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def init_parallel_state(config: TrainConfig, world_size: int) -> ParallelLayout:
    """Create megatron's process groups from the TP/PP/CP flags (DP is what remains)."""
    import_megatron()
    from megatron.core import parallel_state as ps

    from miles_disagg.trainer.megatron.cpu_patches import apply_cpu_patches

    check_layout_support(config)
    tp, pp, cp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.context_parallel_size
    if world_size % (tp * pp * cp):
        raise ConfigError(f"{world_size} trainer ranks do not split into TP {tp} x PP {pp} x CP {cp}",
                          ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"))
    apply_cpu_patches()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ep = config.expert_model_parallel_size
    if world_size % (ep * pp):
        raise ConfigError(f"{world_size} trainer ranks do not split into EP {ep} x PP {pp}",
                          ("--expert-model-parallel-size", "--pipeline-model-parallel-size"))
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=config.expert_tensor_parallel_size)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(config.seed)
    return current_layout()


def check_layout_support(config: TrainConfig) -> None:
    """``ConfigError`` for a layout this machine cannot run: pipeline parallelism needs CUDA
    (megatron's schedules allocate CUDA tensors); context and sequence parallelism need
    Transformer Engine layers (megatron's local attention and norms have neither)."""
    for flag_name, wanted, available, needs in (
            ("--pipeline-model-parallel-size", config.pipeline_model_parallel_size > 1, torch.cuda.is_available(),
             "CUDA"),
            ("--context-parallel-size", config.context_parallel_size > 1, uses_te_spec(), "CUDA and Transformer Engine"),
            ("--sequence-parallel", config.sequence_parallel, uses_te_spec(), "CUDA and Transformer Engine"),
            ("--moe-grouped-gemm", bool(config.moe_grouped_gemm), uses_te_spec(), "CUDA and Transformer Engine"),
            ("--moe-permute-fusion", bool(config.moe_permute_fusion), uses_te_spec(), "CUDA and Transformer Engine")):
        if wanted and not available:
            raise ConfigError(f"{flag_name} needs {needs} with --train-backend megatron (on CPU: tensor, data and expert "
                              "parallelism only)", (flag_name, "--train-backend"))


def check_moe_support(shape: ModelShape, config: TrainConfig, layout: ParallelLayout) -> None:
    """``ConfigError`` for an MoE layout megatron-core or this backend does not train: MoE with
    tensor parallelism needs sequence parallelism (megatron's rule); pipelined schedules do not
    say when a recomputation runs, so replaying routing there is refused."""
    if not shape.is_moe:
        return
    if layout.tp_size > 1 and not config.sequence_parallel:
        raise ConfigError("an MoE model with --tensor-model-parallel-size > 1 needs --sequence-parallel "
                          "(megatron-core's rule; it needs CUDA and Transformer Engine)",
                          ("--tensor-model-parallel-size", "--sequence-parallel"))
    if layout.ep_size > 1 and config.moe_token_dispatcher_type == "allgather":
        raise ConfigError("--moe-token-dispatcher-type allgather needs the same token count on every EP rank; use "
                          "alltoall with --expert-model-parallel-size > 1", ("--moe-token-dispatcher-type",))
    replay = config.use_rollout_routing_replay or config.use_routing_replay
    if layout.pp_size > 1 and config.recompute_granularity is not None and replay:
        raise ConfigError("routing replay with --recompute-granularity is supported without pipeline parallelism "
                          "only (the pipelined schedule recomputes outside this backend's control)",
                          ("--pipeline-model-parallel-size", "--recompute-granularity"))


def current_layout() -> ParallelLayout:
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        tp_size=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
        expert_dp_rank=ps.get_expert_data_parallel_rank())


def read_hf_config(hf_dir: str):
    """The checkpoint's HF config and the :class:`ModelShape` taken from it."""
    from miles_disagg.config.hf_config import read_hf_config as read_config

    config = read_config(hf_dir)
    return config, ModelShape.from_hf_config(config)


def transformer_config(shape: ModelShape, config: TrainConfig, layout: ParallelLayout):
    """megatron's ``TransformerConfig`` for ``shape`` under the trainer's flags. miles' dropout,
    fp32-softmax and attention-backend flags land here; unset, dropout is 0 (RL needs the
    trainer's logprobs to be the policy's, not a dropout sample) and softmax runs in fp32."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if on_gpu else torch.float32
    fields = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim, normalization="RMSNorm", layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=False, qk_layernorm=True, hidden_dropout=_or(config.hidden_dropout, 0.0),
        attention_dropout=_or(config.attention_dropout, 0.0),
        attention_backend=AttnBackend[config.attention_backend or "auto"],
        tensor_model_parallel_size=layout.tp_size, pipeline_model_parallel_size=layout.pp_size,
        context_parallel_size=layout.cp_size,
        sequence_parallel=config.sequence_parallel and layout.tp_size > 1,
        recompute_granularity=config.recompute_granularity, recompute_method=config.recompute_method,
        recompute_num_layers=config.recompute_num_layers,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=on_gpu, variable_seq_lengths=layout.pp_size > 1,
        use_cpu_initialization=not on_gpu, perform_initialization=False,  # weights come from the checkpoint
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        attention_softmax_in_fp32=_or(config.attention_softmax_in_fp32, True))
    if shape.is_moe:
        from miles_disagg.trainer.megatron.moe import moe_config_fields

        fields.update(moe_config_fields(shape, config, layout))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notes about defaults this backend does not set
        return TransformerConfig(**fields)


def _or(value, default):
    return default if value is None else value


def uses_te_spec() -> bool:
    """Whether layers are Transformer Engine's (norms fused into linear_qkv / linear_fc1, causal
    mask built inside attention) rather than megatron's local ones."""
    return torch.cuda.is_available() and has_transformer_engine()


def build_gpt(shape: ModelShape, tconfig, layout: ParallelLayout):
    """This pipeline stage of the GPTModel (logits gathered over TP, untied or tied embeddings)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt import gpt_layer_specs as specs

        if shape.is_moe:
            spec = specs.get_gpt_decoder_block_spec(tconfig, use_transformer_engine=uses_te_spec(),
                                                    normalization="RMSNorm")
        elif uses_te_spec():
            spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
        else:
            spec = specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
        model = GPTModel(
            tconfig, spec, vocab_size=shape.vocab_size, max_sequence_length=shape.max_position_embeddings,
            pre_process=layout.is_first_stage, post_process=layout.is_last_stage, parallel_output=False,
            share_embeddings_and_output_weights=shape.tied_embeddings, position_embedding_type="rope",
            rotary_base=int(shape.rope_theta) if float(shape.rope_theta).is_integer() else shape.rope_theta)
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    return model


def stage_rules(shape: ModelShape, layout: ParallelLayout, grouped_experts: bool = False) -> list[ParamRule]:
    """The rules of this rank's own parameters (its pipeline stage; its EP rank's experts)."""
    rules = param_rules(shape, stage_layers(shape.num_layers, layout.pp_size, layout.pp_rank),
                        pre_process=layout.is_first_stage, post_process=layout.is_last_stage,
                        fused_norms=uses_te_spec(), ep_size=layout.ep_size, grouped_experts=grouped_experts)
    return [rule for rule in rules if rule.ep_owner in (None, layout.ep_rank)]


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_dir: str, shape: ModelShape, layout: ParallelLayout,
                    grouped_experts: bool = False) -> None:
    """Copy this rank's shard of every parameter from the HF checkpoint at ``hf_dir``, and mark
    the TP-split ones as megatron's initialization would (gradient norms count them once).

    ``ConfigError`` when the model's parameters and the conversion rules disagree (a layer
    spec this converter does not know) or the checkpoint lacks a tensor."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
    from safetensors import safe_open

    from miles_disagg.weights.safetensors_io import checkpoint_tensors

    rules = stage_rules(shape, layout, grouped_experts)
    params = dict(model.named_parameters())
    expected = {rule.megatron for rule in rules}
    if set(params) != expected:
        raise ConfigError(f"megatron parameters and conversion rules differ: only in the model "
                          f"{sorted(set(params) - expected)[:5]}, only in the rules {sorted(expected - set(params))[:5]}",
                          ("--train-backend",))
    files = checkpoint_tensors(hf_dir)
    handles: dict[str, object] = {}
    try:
        for rule in rules:
            hf = {}
            for name in rule.hf:
                if name not in files:
                    raise ConfigError(f"{hf_dir} has no tensor {name!r}", ("--hf-checkpoint",))
                file_name = files[name][0]
                if file_name not in handles:
                    handles[file_name] = safe_open(str(Path(hf_dir) / file_name), "pt")
                hf[name] = handles[file_name].get_tensor(name)
            param = params[rule.megatron]
            tp_rank, tp_size = (0, 1) if rule.is_expert else (layout.tp_rank, layout.tp_size)  # expert TP is 1
            param.copy_(to_megatron(rule, hf, shape, tp_rank, tp_size).to(param.dtype))
            if rule.kind != "dup" and not rule.is_expert and not hasattr(param, "tensor_model_parallel"):
                set_tensor_model_parallel_attributes(param, True, 1 if rule.kind == "row" else 0, 1)
    finally:
        handles.clear()
