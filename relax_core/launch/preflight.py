"""Checks run by `relax submit` before anything is written or started.

The schema has already checked the recipe's shape; these check that the run
can work on the executor it will use: the names it uses exist, the batch fits
the model's context, and the backends it asks for are available there. Every
problem is a `RecipeError` (exit code 2) that says what to change.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from relax_core.config.checks import looks_like_hub_id, reference_problems
from relax_core.config.schema import HFModel, Recipe, SyntheticData, TinyModel
from relax_core.errors import RecipeError
from relax_core.models.tiny import TEMPLATE_CHARS

# Algorithms the torch trainer and the colocate loop run end to end; the
# others validate (relax list algorithms shows them) but are refused here.
WIRED_ALGORITHMS = frozenset({
    "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "sapo", "cispo", "m2po",
    "opd", "dapo", "ppo",
})
# Chat-template tokens around one user turn with the tiny tokenizer (one token per
# character, one per special token): "<|im_start|>user\n" ... "<|im_end|>\n<|im_start|>assistant\n".
_TINY_TEMPLATE_TOKENS = 1 + 5 + 1 + 1 + 1 + 10


def resolve_executor(recipe: Recipe) -> str:
    """`auto`: Slurm when `sbatch` is on PATH and a Slurm controller answers, else this machine."""
    if recipe.cluster.executor != "auto":
        return recipe.cluster.executor
    return "slurm" if shutil.which("sbatch") and slurm_answers() else "local"


def slurm_answers() -> bool:
    import subprocess

    try:
        return subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def preflight(recipe: Recipe, recipe_path: str | Path, executor: str) -> None:
    problems = reference_problems(recipe) + _reward_problems(recipe) + _context_problems(recipe)
    problems += _feature_problems(recipe)
    if executor == "local":
        problems += _local_problems(recipe)
    elif executor == "slurm":
        problems += _slurm_problems(recipe)
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        raise RecipeError(f"{recipe_path}: cannot run this recipe ({len(problems)} problem(s)); nothing was started\n{lines}")


def _reward_problems(recipe: Recipe) -> list[str]:
    from relax_core.rewards.registry import RewardPluginError, list_rewards

    try:
        names = list_rewards(recipe.reward.plugin_dirs)
    except RewardPluginError as exc:
        return [f"reward.plugin_dirs: {exc}"]
    if recipe.reward.name in names:
        return []
    return [f"reward.name: no reward called '{recipe.reward.name}' (available: {', '.join(names)})"]


def model_context_length(recipe: Recipe) -> int | None:
    """The model's maximum sequence length, when it can be known on this machine."""
    model = recipe.model
    if isinstance(model, TinyModel):
        return 512
    if isinstance(model, HFModel) and not looks_like_hub_id(model.path):
        config = Path(model.path).expanduser() / "config.json"
        if config.is_file():
            data = json.loads(config.read_text())
            text_config = data.get("text_config", data)
            return text_config.get("max_position_embeddings")
    return None


def _context_problems(recipe: Recipe) -> list[str]:
    ro, problems = recipe.rollout, []
    limit = model_context_length(recipe)
    if limit and ro.max_prompt_len + ro.max_new_tokens > limit:
        problems.append(
            f"rollout.max_new_tokens: max_prompt_len ({ro.max_prompt_len}) + max_new_tokens ({ro.max_new_tokens}) "
            f"exceeds the model's context of {limit} tokens"
        )
    data = recipe.data
    if isinstance(data, SyntheticData) and isinstance(recipe.model, TinyModel):
        missing = sorted(set(data.symbols + ("0123456789+=" if data.task == "add" else "")) -
                         set(recipe.model.alphabet + TEMPLATE_CHARS))
        if missing:
            problems.append(f"model.alphabet: the task uses characters the tokenizer lacks: {''.join(missing)!r}")
        longest = _TINY_TEMPLATE_TOKENS + (2 * data.max_len + 2 if data.task == "add" else data.max_len)
        if longest > ro.max_prompt_len:
            problems.append(f"rollout.max_prompt_len: prompts of the task are up to {longest} tokens; raise it")
    return problems


def _feature_problems(recipe: Recipe) -> list[str]:
    problems = []
    if recipe.algorithm.name not in WIRED_ALGORITHMS:
        problems.append(
            f"algorithm.name: {recipe.algorithm.name} is not available in this version of Relax "
            f"(available: {', '.join(sorted(WIRED_ALGORITHMS))})"
        )
    return problems


def _local_problems(recipe: Recipe) -> list[str]:
    problems = []
    for group in ("train", "rollout"):
        if getattr(recipe.cluster, group).nodes > 1:
            problems.append(f"cluster.{group}.nodes: the local executor runs each node group on this one machine; "
                            "use 1 node (or Slurm)")
    if recipe.rollout.engine == "sglang" and not _has_cuda():
        problems.append("rollout.engine: sglang needs a GPU; on this machine use rollout.engine=cpu rollout.gpus_per_engine=0")
    if recipe.train.backend == "megatron":
        problems.append("train.backend: the megatron backend runs on GPU nodes; on this machine use train.backend=torch")
    return problems


def _slurm_problems(recipe: Recipe) -> list[str]:
    from relax_core.launch.container import check_container

    problems = [f"cluster.slurm: '{tool}' is not on PATH (load Slurm's module, or use --executor local)"
                for tool in ("sbatch", "squeue", "scontrol") if not shutil.which(tool)]
    return problems + check_container(recipe.cluster.container)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
