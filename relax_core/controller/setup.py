"""From a recipe to the pieces the training loop uses.

Maps recipe sections onto the configs of the components (trainer, sampling)
and materialises the model directory every process loads. Kept apart from
the loop so the loop reads like pseudocode.
"""

from __future__ import annotations

from pathlib import Path

from relax_core.config.schema import HFModel, Recipe, TinyModel
from relax_core.launch.rundir import RunDir


def prepare_model_dir(recipe: Recipe, run: RunDir) -> Path:
    """The HF model directory trainers and engines load (built, local, or fetched once)."""
    model = recipe.model
    if isinstance(model, TinyModel):
        from transformers.utils import logging as hf_logging

        from relax_core.models.tiny import materialize_tiny_model

        hf_logging.disable_progress_bar()
        target = run.path / "model"
        if not (target / "config.json").exists():
            materialize_tiny_model(target, seed=model.seed, alphabet=model.alphabet, hidden_size=model.hidden_size,
                                   num_layers=model.num_layers, num_heads=model.num_heads,
                                   num_kv_heads=model.num_kv_heads)
        return target
    assert isinstance(model, HFModel)
    local = Path(model.path).expanduser()
    if local.is_dir():
        return local.resolve()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model.path))


def trainer_config(recipe: Recipe):
    """The torch backend's settings for this recipe."""
    from relax_core.train.config import TorchTrainerConfig

    train, algo = recipe.train, recipe.algorithm
    return TorchTrainerConfig(
        lr=train.lr, weight_decay=train.weight_decay, betas=tuple(train.adam_betas), grad_clip=train.grad_clip,
        lr_schedule=train.lr_schedule, warmup_steps=train.warmup_steps, total_steps=train.steps,
        min_lr_ratio=train.min_lr / train.lr, micro_batch_size=train.micro_batch_size,
        advantage_estimator=algo.name, policy_loss="ppo_clip", eps_low=algo.eps_low, eps_high=algo.eps_high,
        dual_clip_c=algo.dual_clip_c, loss_agg=algo.loss_agg, norm_len=recipe.rollout.max_new_tokens,
        use_kl_loss=algo.kl.coef > 0, kl_coef=algo.kl.coef, kl_estimator=algo.kl.estimator, tis_cap=algo.tis_cap,
        seed=train.seed, dtype=recipe.model.dtype,
    )


def sampling_config(recipe: Recipe):
    from relax_core.rollout.manager import SamplingConfig

    ro = recipe.rollout
    return SamplingConfig(
        n_samples_per_prompt=ro.n_samples_per_prompt, max_new_tokens=ro.max_new_tokens,
        max_prompt_len=ro.max_prompt_len, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
        max_request_batch=ro.max_concurrency, seed=recipe.train.seed,
    )
