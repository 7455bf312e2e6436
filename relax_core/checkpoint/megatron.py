"""Megatron distributed checkpoints of the Megatron backend (`megatron.core.dist_checkpointing`).

`CKPT/iter_XXXXXXX/` is what Megatron-LM's `save_checkpoint` writes with
`--ckpt-format torch_dist`: the sharded state dict of the model (`model`),
of megatron-core's optimizer (`optimizer`, its parameter-keyed form) and the
common entries Megatron-LM reads back (`iteration`, `checkpoint_version`,
`args`, `opt_param_scheduler`, `rng_state` per TP/PP rank), in
`dist_checkpointing`'s files (`*.distcp`, `.metadata`, `common.pt`,
`metadata.json`), plus Relax's `relax` entry (the run's progress: data
cursor, step, policy version), PPO's critic when there is one (`critic`: its
model's sharded tensors under `critic.`, its optimizer's) and `relax_meta.json` (model naming
"megatron", where the HF config is). The layout around it is the torch
backend's: staged in `.tmp_iter_XXXXXXX/`, published by a rename, then the
tracker `latest_checkpointed_iteration.txt`, then pruning (`dcp.py`).

Megatron's sharded tensors are global: a checkpoint saved with one TP/PP/EP
layout loads into another (and into another data-parallel size), as
Megatron-LM allows. `hf_export` reads the model's tensors from the same
files with torch's DCP reader (`hf_weights.checkpoint_to_hf` names them).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from relax_core.checkpoint import dcp, layout
from relax_core.checkpoint.layout import CheckpointError
from relax_core.train.megatron.model import VOCAB_DIVISOR, rope_theta

NAMING = "megatron"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current `checkpoint_version`
PROGRESS_KEY = "relax"
CRITIC_KEY = "critic"  # PPO's critic: its sharded model and optimizer, keys under `critic.` (megatron/critic.py)
# DCP keys of the model section are the names; everything else belongs to these
_NOT_MODEL = ("optimizer.", "chained_", "rng_state", "opt_param_scheduler", "iteration", "args",
              "checkpoint_version", PROGRESS_KEY, CRITIC_KEY)  # `critic.`: the critic's model


def megatron_args(trainer) -> argparse.Namespace:
    """The `args` Megatron-LM saves, complete enough for its `check_checkpoint_args` and for what rebuilds
    the model from them: Megatron-Bridge's `_transformer_config_from_args` (training/mlm_compat/
    arguments.py, 0.3.1) copies every `TransformerConfig` field the args have, then reads Megatron-LM's
    own names (`norm_epsilon`, `swiglu`, `multi_latent_attention`, `num_experts`, `cp_comm_type`, ...);
    its `_gpt_provider` (mlm_compat/model.py) reads the layer spec's and GPTModel's (`transformer_impl`,
    `qk_l2_norm`, `padded_vocab_size`, `use_rope_scaling`, ...). So: the model's own config, field by
    field, and Megatron-LM's names on top, each with the value this model was built with."""
    c, par, cfg = trainer.hf_config, trainer.par, trainer.config
    config = trainer.module.config
    heads = c["num_attention_heads"]
    groups = c.get("num_key_value_heads") or heads
    args = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if _plain(getattr(config, f.name))}
    args.update(
        # the architecture, in Megatron-LM's names
        num_query_groups=groups, group_query_attention=groups != heads, norm_epsilon=config.layernorm_epsilon,
        swiglu=True, squared_relu=False, multi_latent_attention=False, heterogeneous_layers_config_path=None,
        is_hybrid_model=False, experimental_attention_variant=None, qk_l2_norm=False, apply_layernorm_1p=False,
        no_persist_layer_norm=not config.persist_layer_norm, bias_swiglu_fusion=config.bias_activation_fusion,
        bias_gelu_fusion=False, init_method_xavier_uniform=False, rotary_interleaved=config.rotary_interleaved,
        num_experts=config.num_moe_experts, moe_grouped_gemm=False, moe_use_legacy_grouped_gemm=False,
        moe_layer_freq=1, moe_router_score_function="softmax", moe_shared_expert_intermediate_size=None,
        mtp_num_layers=None, decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
        fp8_param_gather=False, overlap_p2p_comm=False, cp_comm_type=[config.cp_comm_type or "p2p"],
        config_logger_dir="", spec=None, transformer_impl="local", init_model_with_meta_device=False,
        # GPTModel's arguments
        padded_vocab_size=trainer.module.vocab_size, max_position_embeddings=c.get("max_position_embeddings"),
        seq_length=c.get("max_position_embeddings"), position_embedding_type="rope", add_position_embedding=False,
        use_rotary_position_embeddings=True, rotary_base=rope_theta(c), rotary_percent=1.0, use_rope_scaling=False,
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings"), fp16_lm_cross_entropy=False,
        make_vocab_size_divisible_by=VOCAB_DIVISOR, swiglu_ffn_hidden_size=None,
        # precision
        params_dtype=getattr(torch, cfg.dtype), bf16=cfg.dtype == "bfloat16", fp16=False,
        # the run
        tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp, context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep, sequence_parallel=par.sequence_parallel,
        virtual_pipeline_model_parallel_size=None, use_distributed_optimizer=trainer.distributed_optimizer,
        data_parallel_size=trainer.world_size, world_size=dist.get_world_size(), seed=cfg.seed, lr=cfg.lr,
        iteration=trainer.step, consumed_train_samples=trainer.step * cfg.samples_per_step,
        skipped_train_samples=0, consumed_valid_samples=0, global_batch_size=cfg.samples_per_step,
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(trainer.model_path),
        data_parallel_random_init=False, no_save_optim=False, no_save_rng=False, ckpt_fully_parallel_save=False,
        ckpt_format="torch_dist",
    )
    return argparse.Namespace(**args)


def _plain(value) -> bool:
    """A value Megatron-LM's args could hold (no functions, process groups or other objects)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, enum.Enum)):
        return True
    return isinstance(value, (list, tuple)) and all(_plain(v) for v in value)


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def _sharded_rng(state: dict[str, Any] | None = None):
    """Megatron-LM's `rng_state` entry (`get_rng_state`): a list of one rank's states, one object per TP x PP
    rank (the data-parallel replicas hold copies), or with expert parallelism per TP x PP x DP rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    pp, tp = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    pp_n, tp_n = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    states = [state if state is not None else _rng_state()]
    if ps.get_expert_model_parallel_world_size() > 1:
        dp, dp_n = (ps.get_data_parallel_rank(with_context_parallel=True),
                    ps.get_data_parallel_world_size(with_context_parallel=True))
        return ShardedObject("rng_state", states, (pp_n, tp_n, dp_n), (pp, tp, dp), replica_id=0)
    return ShardedObject("rng_state", states, (pp_n, tp_n), (pp, tp),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _state(trainer, iteration: int, progress: dict[str, Any] | None, rng: bool = True, *,
           loading: bool = False) -> dict[str, Any]:
    state = trainer.sharded_state_dict(loading=loading)
    state.update(iteration=iteration, checkpoint_version=CHECKPOINT_VERSION, args=megatron_args(trainer))
    if progress is not None:
        state[PROGRESS_KEY] = progress
    if rng:
        state["rng_state"] = _sharded_rng()
    return state


def save(ckpt_dir: str | os.PathLike, iteration: int, trainer, progress: dict[str, Any], *,
         keep_last: int | None = None, hf_dir: str | os.PathLike | None = None) -> Path:
    """Write `CKPT/iter_{iteration:07d}/` as a Megatron distributed checkpoint and mark it latest; every rank
    of the trainer world calls this."""
    from megatron.core import dist_checkpointing

    from relax_core.train.megatron import compat

    root = Path(ckpt_dir)
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    staging = layout.tmp_dir_for(root, layout.iteration_dirname(iteration))
    dcp._on_rank0(lambda: dcp._prepare(root, staging), None)
    with compat.on_device():
        dist_checkpointing.save(_state(trainer, iteration, progress), str(staging),
                                content_metadata=trainer.CONTENT_METADATA)
    meta = dcp._meta(iteration, hf_dir, NAMING, None)
    meta["megatron"] = {"tp": trainer.par.tp, "pp": trainer.par.pp, "ep": trainer.par.ep, "dp": trainer.world_size,
                        "distributed_optimizer": trainer.distributed_optimizer,
                        "critic": getattr(trainer, "critic", None) is not None}
    dcp._on_rank0(lambda: dcp._finish(root, staging, iteration, meta, None, hf_dir, keep_last), None)
    return layout.get_checkpoint_name(root, iteration)


def load(ckpt_dir: str | os.PathLike, trainer, iteration: int | None = None) -> dict[str, Any]:
    """Load the latest (or the given) iteration into the trainer (model, optimizer, schedule, RNG of this
    TP/PP rank); returns the run's progress. Every rank calls this."""
    from megatron.core import dist_checkpointing

    from relax_core.train.megatron import compat

    iteration, iter_dir = layout.resolve_iteration(ckpt_dir, iteration)
    meta = layout.read_meta(iter_dir)
    if meta.get("model_naming") != NAMING:
        raise CheckpointError(f"{iter_dir} was written by the {meta.get('model_naming')!r} backend "
                              "(train.backend=torch); the megatron backend resumes its own checkpoints only")
    saved = (meta.get("megatron") or {}).get("distributed_optimizer", False)
    if saved != trainer.distributed_optimizer:
        raise CheckpointError(f"{iter_dir} was saved with train.distributed_optimizer={str(saved).lower()}: the "
                              "optimizer state is stored differently; resume with the same setting")
    if getattr(trainer, "critic", None) is not None and not (meta.get("megatron") or {}).get("critic"):
        raise CheckpointError(f"{iter_dir} holds no critic: it was saved by a run without one")
    # The RNG states are one per TP x PP rank: with another TP or PP size there is none for this rank, and
    # (as Megatron-LM does) they are left as seeded.
    grid = meta.get("megatron") or {}
    same_grid = (grid.get("tp"), grid.get("pp")) == (trainer.par.tp, trainer.par.pp)
    if trainer.par.ep > 1 or grid.get("ep", 1) > 1:  # the states are per data-parallel rank too
        same_grid = same_grid and grid.get("ep") == trainer.par.ep and grid.get("dp") == trainer.world_size
    template = _state(trainer, iteration, None, rng=same_grid, loading=True)
    template.pop("args")
    with compat.on_device():
        loaded = dist_checkpointing.load(template, str(iter_dir))
    trainer.load_sharded(loaded)
    trainer.step = int(loaded["iteration"])
    if same_grid:
        _restore_rng(loaded["rng_state"][0] if isinstance(loaded["rng_state"], list) else loaded["rng_state"])
    common = dist_checkpointing.load_common_state_dict(str(iter_dir))
    return common.get(PROGRESS_KEY, {})


def _restore_rng(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if _same_kind(tracker.get_states(), state["rng_tracker_states"]):  # not a CPU run's states on a GPU
        tracker.set_states(state["rng_tracker_states"])


def _same_kind(current: dict[str, Any], saved: dict[str, Any]) -> bool:
    """The saved tracker states are states of this device's generator (same names, same sizes)."""
    return current.keys() == saved.keys() and all(
        torch.is_tensor(saved[k]) and saved[k].numel() == current[k].numel() for k in current)


def model_keys(metadata) -> list[str]:
    """The model's tensors in a Megatron checkpoint's DCP metadata (optimizer, RNG and `_extra_state` left
    out)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return [name for name, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata) and not name.startswith(_NOT_MODEL)
            and "_extra_state" not in name]


def saved_dtype(metadata) -> torch.dtype:
    """The dtype the checkpoint holds the model's weights in (the run's parameter dtype)."""
    dtypes = {metadata.state_dict_metadata[name].properties.dtype for name in model_keys(metadata)}
    return torch.float32 if torch.float32 in dtypes or not dtypes else dtypes.pop()


def reference_model(iter_dir: Path, config: dict[str, Any], *, dtype: torch.dtype = torch.float32,
                    device: str = "cpu"):
    """The megatron-core model of a checkpoint, on this process alone (TP = PP = EP = 1, whatever layout
    the run saved with: `dist_checkpointing` reshards), every parameter in `dtype` on `device`, as an
    HF-like causal LM (`forward.CausalLM`). The checkpoint is read into the model's own parameters: the
    model is all the memory it takes."""
    from megatron.core import dist_checkpointing

    from relax_core.train.megatron import compat
    from relax_core.train.megatron.forward import CausalLM
    from relax_core.train.megatron.model import Parallel, build_model
    from relax_core.train.megatron.parallel import initialize
    from relax_core.train.megatron.trainer import ensure_world

    compat.install(device)
    ensure_world(device)
    initialize(Parallel(), seed=0, device=device)
    model = build_model(config, Parallel(), dtype=str(dtype).removeprefix("torch."), device=device)
    model.to(dtype)  # the norms too (megatron-core makes them in fp32)
    template = model.sharded_state_dict()
    with compat.on_device():
        loaded = dist_checkpointing.load(template, str(iter_dir))
    model.load_state_dict({key: value for key, value in loaded.items() if key in template})  # not the common
    return CausalLM(model.eval(), config["vocab_size"]).eval()
