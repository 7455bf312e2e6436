"""Qwen3 and Qwen3-MoE as megatron-core `GPTModel`s, built from the Hugging Face config.

`transformer_config` reads the HF `config.json` (a dict) and the recipe's
parallel sizes; `build_model` builds this rank's pipeline stage with
megatron-core's own modules (the "local" layer spec: no Transformer Engine,
so the same model runs on CPU and GPU and its parameter names are those of
Megatron-LM's `--transformer-impl local`), attending with torch's SDPA
(attention.py). Dropout is off: the trainer's
log-probs must equal the engines'.

What the HF config may say and what is refused (`unsupported`, exit 2 at
submit): rope scaling, sliding windows, MoE layers mixed with dense ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
VOCAB_DIVISOR = 128  # Megatron-LM's --make-vocab-size-divisible-by default
NOT_YET = "is not available in this version of Relax"


@dataclass(frozen=True)
class Parallel:
    """The recipe's model-parallel sizes (`train.tensor_parallel`, ...)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp


@dataclass(frozen=True)
class MegatronOptions:
    """What the recipe's `train` section says of the megatron backend beyond the torch backend's settings."""

    parallel: Parallel = Parallel()
    distributed_optimizer: bool = False


def family(config: dict[str, Any]) -> str | None:
    """"qwen3" / "qwen3_moe" for a config this backend builds, else None."""
    for arch in config.get("architectures") or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    return {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}.get(config.get("model_type", ""))


def num_experts(config: dict[str, Any]) -> int:
    """Experts per MoE layer (`num_experts`; transformers 5 writes `num_local_experts`); 0 for a dense model."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def unsupported(config: dict[str, Any], par: Parallel) -> list[str]:
    """Why this HF config cannot be trained with these parallel sizes (empty: it can)."""
    problems = []
    kind = family(config)
    if kind is None:
        return [f"model: {config.get('architectures') or config.get('model_type')} with train.backend=megatron "
                f"(it builds Qwen3 and Qwen3-MoE) {NOT_YET}; use train.backend=torch"]
    heads, groups, layers = config["num_attention_heads"], config.get("num_key_value_heads") or \
        config["num_attention_heads"], config["num_hidden_layers"]
    if heads % par.tp or groups % par.tp:
        problems.append(f"train.tensor_parallel: {par.tp} must divide the model's {heads} attention heads "
                        f"and {groups} key/value heads")
    if layers % par.pp:
        problems.append(f"train.pipeline_parallel: {par.pp} must divide the model's {layers} layers")
    rope = config.get("rope_parameters") or {}
    if config.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        problems.append(f"model: rope scaling (config.json) with train.backend=megatron {NOT_YET}")
    if config.get("use_sliding_window"):
        problems.append(f"model: sliding-window attention with train.backend=megatron {NOT_YET}")
    if kind == "qwen3_moe":
        experts = num_experts(config)
        if experts % par.ep:
            problems.append(f"train.expert_parallel: {par.ep} must divide the model's {experts} experts")
        if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
            problems.append(f"model: Qwen3-MoE with dense layers among the MoE ones (mlp_only_layers, "
                            f"decoder_sparse_step) {NOT_YET}")
    elif par.ep > 1:
        problems.append("train.expert_parallel: > 1 needs a mixture-of-experts model (Qwen3-MoE)")
    if par.sequence_parallel and par.tp == 1:
        problems.append("train.sequence_parallel: needs train.tensor_parallel > 1")
    return problems


def rope_theta(config: dict[str, Any]) -> float:
    """RoPE's base: `rope_theta` (transformers 4) or `rope_parameters.rope_theta` (5)."""
    return float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Megatron-LM's padding: a multiple of 128 x TP, so every TP rank holds an equal slice."""
    multiple = VOCAB_DIVISOR * tp
    return -(-vocab_size // multiple) * multiple


def transformer_config(config: dict[str, Any], par: Parallel, *, dtype: str = "float32",
                       recompute: bool = False, cpu_init: bool = True):
    """megatron-core's `TransformerConfig` for this HF config and these parallel sizes."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    params_dtype = getattr(torch, dtype)
    heads = config["num_attention_heads"]
    kwargs: dict[str, Any] = dict(
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        num_attention_heads=heads, num_query_groups=config.get("num_key_value_heads") or heads,
        kv_channels=config.get("head_dim") or config["hidden_size"] // heads,
        ffn_hidden_size=config["intermediate_size"], normalization="RMSNorm",
        layernorm_epsilon=config.get("rms_norm_eps", 1e-6), gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=bool(config.get("attention_bias", False)), qk_layernorm=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp,
        context_parallel_size=par.cp, expert_model_parallel_size=par.ep, sequence_parallel=par.sequence_parallel,
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=dtype == "bfloat16",
        use_cpu_initialization=cpu_init, init_method_std=config.get("initializer_range", 0.02),
        # The pipeline's stages tell each other each micro-batch's shape (its length varies). The experts'
        # tokens are exchanged with all-to-all, which takes a different token count from each rank (the
        # allgather dispatcher needs equal ones); megatron-core wants it with variable lengths even in a
        # dense model (which has no dispatcher).
        variable_seq_lengths=par.pp > 1, moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=True, attention_softmax_in_fp32=True, transformer_impl="local",
    )
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if family(config) == "qwen3_moe":
        kwargs.update(
            num_moe_experts=num_experts(config), moe_router_topk=config["num_experts_per_tok"],
            moe_ffn_hidden_size=config["moe_intermediate_size"],
            moe_grouped_gemm=False, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            # HF: softmax over all experts, top-k, renormalised when norm_topk_prob (Megatron's default:
            # softmax over the top-k, the same numbers); without it the pre-softmax scores are kept.
            moe_router_pre_softmax=not config.get("norm_topk_prob", True), moe_router_dtype="fp32",
            moe_permute_fusion=False,
        )
    return TransformerConfig(**kwargs)


def layer_spec(config: dict[str, Any]):
    """megatron-core's local layer spec, attending with torch's SDPA (`attention.SegmentAttention`: packed
    rows sample by sample, no `[L x L]` scores or mask) instead of its `DotProductAttention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from relax_core.train.megatron.attention import SegmentAttention

    experts = num_experts(config) if family(config) == "qwen3_moe" else None
    spec = get_gpt_layer_local_spec(experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SegmentAttention
    return spec


def build_model(config: dict[str, Any], par: Parallel, *, dtype: str = "float32", recompute: bool = False,
                device: str = "cpu"):
    """This rank's stage of the model (parallel state initialised: `parallel.initialize`) on `device`, in
    eval mode (dropout is off anyway; eval keeps any module-level randomness out).

    Off the CPU megatron-core makes its weights on CUDA's current device (without a GPU the trainer's:
    `compat.install`), as on a GPU; what it makes on the host regardless (torch's norms) is moved there
    keeping megatron-core's attributes (`tensor_model_parallel`, `allreduce`, `sequence_parallel`, ...),
    which the optimizer and the gradient reductions read."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from relax_core.train.megatron import compat

    target = torch.device(device)
    if target.type == "cuda" and target.index is None:  # what the tensors report: cuda:N
        target = torch.device("cuda", torch.cuda.current_device())
    tc = transformer_config(config, par, dtype=dtype, recompute=recompute, cpu_init=target.type == "cpu")
    with compat.on_device():
        model = GPTModel(
            tc, layer_spec(config), vocab_size=padded_vocab(config["vocab_size"], par.tp),
            max_sequence_length=config.get("max_position_embeddings", 4096),
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
            parallel_output=True, share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings")),
            position_embedding_type="rope", rotary_base=rope_theta(config),
        )
    return move(model, target)


def move(module, device):
    """`module` with every parameter and buffer on `device`; a moved parameter keeps its attributes."""
    import torch

    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and param.device != device:
                moved = torch.nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
                moved.__dict__.update({k: v for k, v in param.__dict__.items() if k not in moved.__dict__})
                sub._parameters[name] = moved
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and buffer.device != device:
                sub._buffers[name] = buffer.to(device)
    return module
