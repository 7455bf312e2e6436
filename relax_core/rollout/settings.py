"""From a recipe to the rollout's settings: sampling, media prompts, the CPU engine's video sampling, and the
agentic parts (chat turns, environments, agent programs) that a rollout manager takes."""

from __future__ import annotations

from pathlib import Path

from relax_core.config.schema import Recipe
from relax_core.models.model_dir import trust_remote_code


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
    from relax_core.config.data import FileData

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
