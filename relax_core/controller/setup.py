"""From a recipe to the pieces the training loop uses.

Maps recipe sections onto the configs of the components (trainer, sampling)
and materialises the model directory every process loads. Kept apart from
the loop so the loop reads like pseudocode.

That directory is the one place the model and its tokenizer are chosen: with
`model.tokenizer` it is `<run>/model`, the model's files linked in and the
named tokenizer saved in place of the model's own, so the driver, the
engines, the router and the checkpoint's HF copy all load the same tokenizer.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from relax_core.config.schema import HFModel, Recipe, TinyModel
from relax_core.rundir import RunDir

# Files of a model directory that belong to its tokenizer; `model.tokenizer` replaces all of them.
TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt",
    "merges.txt",
})
log = logging.getLogger(__name__)
_prepared: dict[tuple[str, str], Path] = {}  # (run directory, model section) -> its model directory


def trust_remote_code(recipe: Recipe) -> bool:
    """`model.trust_remote_code`: every HF model, config and tokenizer the run loads may run their own code."""
    return isinstance(recipe.model, HFModel) and recipe.model.trust_remote_code


def with_fetched(recipe: Recipe, run: RunDir) -> Recipe:
    """The recipe with each hub id replaced by the folder `relax submit` fetched it to on the login node
    (run.json's `hub`, field -> folder; launch/hub.py), so the job's processes load those and never ask the hub."""
    fetched = run.read_state().get("hub") or {}
    if not fetched:
        return recipe
    values = recipe.model_dump(mode="json")
    for field, folder in fetched.items():
        *parents, last = field.split(".")
        section = values
        for part in parents:
            section = section[part]
        log.info("%s: %s from the login node's fetch: %s", field, section[last], folder)
        section[last] = folder
    return Recipe.model_validate(values)


def prepare_model_dir(recipe: Recipe, run: RunDir) -> Path:
    """The HF model directory trainers and engines load (built, local, or fetched once).

    Once per process and run: the local driver prepares it while Ray starts
    (entrypoints/local_driver.py), and the job then finds it ready.
    """
    recipe = with_fetched(recipe, run)
    key = (str(run.path), recipe.model.model_dump_json())
    if key not in _prepared or not _prepared[key].exists():
        _prepared[key] = _model_dir(recipe, run)
        log.info("model directory ready: %s", _prepared[key])
    return _prepared[key]


def _model_dir(recipe: Recipe, run: RunDir) -> Path:
    model = recipe.model
    target = run.path / "model"
    if isinstance(model, TinyModel):
        from transformers.utils import logging as hf_logging

        from relax_core.models.tiny import materialize_tiny_model

        hf_logging.disable_progress_bar()
        if not (target / "config.json").exists():
            materialize_tiny_model(target, architecture=model.architecture, seed=model.seed,
                                   alphabet=model.alphabet, hidden_size=model.hidden_size,
                                   num_layers=model.num_layers, num_heads=model.num_heads,
                                   num_kv_heads=model.num_kv_heads)
        return target
    assert isinstance(model, HFModel)
    source = resolve_model_path(model.path)
    if model.tokenizer is None:
        return source
    return with_tokenizer(source, model.tokenizer, target, trust_remote_code=model.trust_remote_code)


def with_tokenizer(model_dir: Path, tokenizer: str, target: Path, *, trust_remote_code: bool) -> Path:
    """`target`: `model_dir`'s files linked in, its tokenizer files replaced by `tokenizer`'s (rebuilt each
    start, so it follows the recipe; staged, then renamed, so it is never half written)."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code)
    staging = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for entry in model_dir.iterdir():
        if entry.name not in TOKENIZER_FILES:
            os.symlink(entry.resolve(), staging / entry.name)
    loaded.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    os.rename(staging, target)
    return target


def resolve_model_path(path: str) -> Path:
    """A local HF model directory as is, else the hub snapshot of that id (fetched once)."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local.resolve()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path))


def trainer_config(recipe: Recipe):
    """The torch backend's settings for this recipe."""
    from relax_core.services.launch import reference_service
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


def media_prompts(recipe: Recipe, model_dir: Path):
    """What prepares the rows with images, video or audio (rollout/prompt_prep.py); None for text data."""
    from relax_core.data.prompts import media_view

    data = media_view(recipe.data)
    if data is None:
        return None
    from relax_core.data.media import MediaBounds
    from relax_core.rollout.prompt_prep import MediaPrompts

    return MediaPrompts(str(model_dir), MediaBounds.from_data(data), data.system_prompt,
                        recipe.rollout.max_prompt_len, recipe.rollout.media_workers, trust_remote_code(recipe))


def engine_video(recipe: Recipe) -> dict:
    """How the CPU engine samples a video into frames: the data set's own settings, so it reads the frames the
    trainer reads ({} without a video column: the engine's defaults)."""
    from relax_core.data.prompts import media_view

    data = media_view(recipe.data)
    if data is None or not data.video_key:
        return {}
    fields = ("video_fps", "video_min_frames", "video_max_frames")
    return {name: getattr(data, name) for name in fields if getattr(data, name) is not None}


def sampling_config(recipe: Recipe):
    from relax_core.rollout.manager import SamplingConfig

    ro = recipe.rollout
    return SamplingConfig(
        n_samples_per_prompt=ro.n_samples_per_prompt, max_new_tokens=ro.max_new_tokens,
        max_prompt_len=ro.max_prompt_len, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
        # Behind a router each request is one sample (the router takes one set of sampling parameters
        # per request, and each sample has its own seed); the group's routing key keeps a prompt's
        # samples on one engine, whose prefix cache then serves the whole group.
        max_request_batch=1 if ro.uses_router else ro.max_concurrency,
        seed=recipe.train.seed, max_concurrency=ro.max_concurrency,
    )


def agentic(recipe: Recipe, tokenizer):
    """What runs multi-turn trajectories for the rollout manager (`rollout.env` or `rollout.agent`); None
    without either."""
    from relax_core.config.schema import FileData

    ro = recipe.rollout
    if not ro.agentic:
        return None
    from relax_core.rollout.chat_turns import ChatTurns

    system = recipe.data.system_prompt if isinstance(recipe.data, FileData) else None
    chat = ChatTurns(tokenizer, recipe.data.apply_chat_template, system)
    if ro.env is not None:
        from relax_core.rollout.multiturn import EnvEpisodes

        return EnvEpisodes(ro.env, chat, ro.max_new_tokens, ro.max_prompt_len)
    from relax_core.rollout.agent_app import AgentPrograms

    return AgentPrograms(ro.agent, chat, ro.max_new_tokens, ro.max_prompt_len)
