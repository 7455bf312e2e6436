"""Megatron distributed checkpoints of the Megatron backend (`megatron.core.dist_checkpointing`).

`CKPT/iter_XXXXXXX/` is what Megatron-LM's `save_checkpoint` writes with
`--ckpt-format torch_dist`: the sharded state dict of the model (`model`),
of megatron-core's optimizer (`optimizer`, its parameter-keyed form) and the
common entries Megatron-LM reads back (`iteration`, `checkpoint_version`,
`args`, `opt_param_scheduler`, `rng_state` per TP/PP rank), in
`dist_checkpointing`'s files (`*.distcp`, `.metadata`, `common.pt`,
`metadata.json`), plus Relax's `relax` entry (the run's progress: data
cursor, step, policy version), PPO's critic when there is one (`critic`,
the torch backend's replicated value model) and `relax_meta.json` (model naming
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
CRITIC_KEY = "critic"  # PPO's critic (the torch backend's, replicated on every rank)
# DCP keys of the model section are the names; everything else belongs to these
_NOT_MODEL = ("optimizer.", "chained_", "rng_state", "opt_param_scheduler", "iteration", "args",
              "checkpoint_version", PROGRESS_KEY, CRITIC_KEY)


def megatron_args(trainer) -> argparse.Namespace:
    """The `args` Megatron-LM checks when it loads a checkpoint (`check_checkpoint_args`)."""
    c, par = trainer.hf_config, trainer.par
    heads = c["num_attention_heads"]
    return argparse.Namespace(
        num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], ffn_hidden_size=c["intermediate_size"],
        num_attention_heads=heads, num_query_groups=c.get("num_key_value_heads") or heads,
        group_query_attention=(c.get("num_key_value_heads") or heads) != heads,
        kv_channels=c.get("head_dim") or c["hidden_size"] // heads, max_position_embeddings=c.get(
            "max_position_embeddings"), position_embedding_type="rope", normalization="RMSNorm",
        swiglu=True, qk_layernorm=True, untie_embeddings_and_output_weights=not c.get("tie_word_embeddings"),
        padded_vocab_size=trainer.module.vocab_size, tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp, context_parallel_size=par.cp, expert_model_parallel_size=par.ep,
        sequence_parallel=par.sequence_parallel, num_experts=c.get("num_experts") or c.get("num_local_experts"),
        moe_router_topk=c.get("num_experts_per_tok"), transformer_impl="local", ckpt_format="torch_dist",
        params_dtype=getattr(torch, trainer.config.dtype), bf16=trainer.config.dtype == "bfloat16", fp16=False,
        use_distributed_optimizer=trainer.distributed_optimizer, data_parallel_size=trainer.world_size,
        world_size=dist.get_world_size(), seed=trainer.config.seed, lr=trainer.config.lr,
        iteration=trainer.step, consumed_train_samples=trainer.step * trainer.config.samples_per_step,
        skipped_train_samples=0, consumed_valid_samples=0, global_batch_size=trainer.config.samples_per_step,
        make_vocab_size_divisible_by=VOCAB_DIVISOR, tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=str(trainer.model_path), data_parallel_random_init=False, no_save_optim=False,
        no_save_rng=False, ckpt_fully_parallel_save=False, add_position_embedding=False,
        use_rotary_position_embeddings=True, rotary_base=rope_theta(c), rotary_percent=1.0,
        rotary_interleaved=False, add_bias_linear=False, add_qkv_bias=bool(c.get("attention_bias")),
        apply_layernorm_1p=False, attention_dropout=0.0, hidden_dropout=0.0, seq_length=c.get(
            "max_position_embeddings"), virtual_pipeline_model_parallel_size=None,
        moe_ffn_hidden_size=c.get("moe_intermediate_size"), moe_grouped_gemm=False, moe_layer_freq=1,
        moe_token_dispatcher_type="alltoall", moe_router_score_function="softmax",
        moe_router_pre_softmax=not c.get("norm_topk_prob", True), moe_shared_expert_intermediate_size=None,
    )


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
    if getattr(trainer, "critic", None) is not None and not loading:  # replicated: saved once, in common.pt
        state[CRITIC_KEY] = trainer.critic.state_dict()
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
    with compat.on_cpu():
        dist_checkpointing.save(_state(trainer, iteration, progress), str(staging),
                                content_metadata=trainer.CONTENT_METADATA)
    meta = dcp._meta(iteration, hf_dir, NAMING, None)
    meta["megatron"] = {"tp": trainer.par.tp, "pp": trainer.par.pp, "ep": trainer.par.ep, "dp": trainer.world_size,
                        "distributed_optimizer": trainer.distributed_optimizer}
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
    # The RNG states are one per TP x PP rank: with another TP or PP size there is none for this rank, and
    # (as Megatron-LM does) they are left as seeded.
    grid = meta.get("megatron") or {}
    same_grid = (grid.get("tp"), grid.get("pp")) == (trainer.par.tp, trainer.par.pp)
    if trainer.par.ep > 1 or grid.get("ep", 1) > 1:  # the states are per data-parallel rank too
        same_grid = same_grid and grid.get("ep") == trainer.par.ep and grid.get("dp") == trainer.world_size
    template = _state(trainer, iteration, None, rng=same_grid, loading=True)
    template.pop("args")
    with compat.on_cpu():
        loaded = dist_checkpointing.load(template, str(iter_dir))
    trainer.load_sharded(loaded)
    trainer.step = int(loaded["iteration"])
    if same_grid:
        _restore_rng(loaded["rng_state"][0] if isinstance(loaded["rng_state"], list) else loaded["rng_state"])
    common = dist_checkpointing.load_common_state_dict(str(iter_dir))
    if getattr(trainer, "critic", None) is not None:
        if CRITIC_KEY not in common:
            raise CheckpointError(f"{iter_dir} holds no critic: it was saved by a run without one")
        trainer.critic.load_state_dict(common[CRITIC_KEY])
    return common.get(PROGRESS_KEY, {})


def _restore_rng(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def model_keys(metadata) -> list[str]:
    """The model's tensors in a Megatron checkpoint's DCP metadata (optimizer, RNG and `_extra_state` left
    out)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return [name for name, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata) and not name.startswith(_NOT_MODEL)
            and "_extra_state" not in name]


def reference_model(iter_dir: Path, config: dict[str, Any]):
    """The megatron-core model of a checkpoint, on this process alone (TP = PP = EP = 1, whatever layout
    the run saved with: `dist_checkpointing` reshards), as an HF-like causal LM (`forward.CausalLM`)."""
    from megatron.core import dist_checkpointing

    from relax_core.train.megatron import compat
    from relax_core.train.megatron.forward import CausalLM
    from relax_core.train.megatron.model import Parallel, build_model
    from relax_core.train.megatron.parallel import initialize
    from relax_core.train.megatron.trainer import ensure_world

    ensure_world("cpu")
    initialize(Parallel(), seed=0)
    model = build_model(config, Parallel())
    template = model.sharded_state_dict()
    with compat.on_cpu():
        loaded = dist_checkpointing.load(template, str(iter_dir))
    model.load_state_dict({key: value for key, value in loaded.items() if key in template})  # not the common
    return CausalLM(model.eval(), config["vocab_size"]).eval()
