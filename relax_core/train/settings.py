"""From a recipe to the trainer's settings: the torch backend's `TorchTrainerConfig` and megatron's options
(relax_core/train/config.py, relax_core/train/megatron/model.py), the one mapping every trainer rank, test
and benchmark goes through."""

from __future__ import annotations

from relax_core.config.schema import Recipe
from relax_core.models.model_dir import resolve_model_path, trust_remote_code


def trainer_config(recipe: Recipe):
    """The torch backend's settings for this recipe."""
    from relax_core.config.modes import reference_service
    from relax_core.train.config import TorchTrainerConfig

    train, algo = recipe.train, recipe.algorithm
    return TorchTrainerConfig(
        lr=train.lr, weight_decay=train.weight_decay, betas=tuple(train.adam_betas), grad_clip=train.grad_clip,
        lr_schedule=train.lr_schedule, warmup_steps=train.warmup_steps, total_steps=train.steps,
        min_lr_ratio=train.min_lr / train.lr, micro_batch_size=train.micro_batch_size,
        num_mini_batches=recipe.samples_per_step // (train.global_batch_size or recipe.samples_per_step),
        num_epochs=train.ppo_epochs,
        algorithm=algo.name, estimator_kwargs=algo.estimator_kwargs(), loss_kwargs=algo.loss_kwargs(),
        selection_kwargs=algo.selection_kwargs(), loss_agg=algo.loss_agg,
        norm_len=algo.norm_len or recipe.rollout.max_new_tokens,
        use_kl_loss=algo.kl_loss_coef > 0, kl_coef=algo.kl_loss_coef, use_reference=algo.uses_reference,
        reference_service=reference_service(recipe),
        kl_estimator=algo.kl.estimator, tis_cap=algo.effective_tis_cap(recipe.mode), seed=train.seed,
        dtype=recipe.model.dtype, trust_remote_code=trust_remote_code(recipe), samples_per_step=recipe.samples_per_step,
        max_tokens_per_micro_batch=train.max_tokens_per_gpu,
        **_teacher(algo), **_critic(algo), **_torch_backend(recipe), **_megatron_backend(recipe),
    )


def _megatron_backend(recipe: Recipe) -> dict:
    """The megatron backend's device and recomputation (its other fields: `megatron_options`)."""
    train = recipe.train
    if train.backend != "megatron":
        return {}
    return {"device": "cuda" if recipe.cluster.train.gpus_per_node > 0 else "cpu",
            "recompute_activations": train.recompute_activations}


def megatron_options(recipe: Recipe):
    """The megatron backend's parallel layout (`train/megatron/model.MegatronOptions`); None for torch."""
    train = recipe.train
    if train.backend != "megatron":
        return None
    from relax_core.train.megatron.model import MegatronOptions, Parallel

    return MegatronOptions(Parallel(train.tensor_parallel, train.pipeline_parallel, train.context_parallel,
                                    train.expert_parallel, train.sequence_parallel),
                           distributed_optimizer=train.distributed_optimizer)


def _torch_backend(recipe: Recipe) -> dict:
    """Device, sharding, recomputation and token budget of the torch backend (its own recipe fields)."""
    train = recipe.train
    if train.backend != "torch":
        return {}
    gpus = recipe.cluster.train.gpus_per_node > 0
    return {"device": "cuda" if gpus else "cpu", "fsdp": train.fsdp if train.fsdp is not None else gpus,
            "recompute_activations": train.recompute_activations,
            "freeze_vision": train.freeze_vision, "freeze_audio": train.freeze_audio}


def _critic(algo) -> dict:
    critic = getattr(algo, "critic", None)
    if critic is None:
        return {}
    path = str(resolve_model_path(critic.init_from)) if critic.init_from else None
    return {"critic_lr": critic.lr, "critic_path": path, "critic_value_clip": critic.value_clip,
            "critic_warmup_steps": critic.warmup_steps}


def _teacher(algo) -> dict:
    teacher = getattr(algo, "teacher", None)
    if teacher is None:
        return {}
    return {"teacher_path": str(resolve_model_path(teacher.path)), "teacher_dtype": teacher.dtype}
