"""Checks run by `relax submit` before anything is written or started.

The schema has already checked the recipe's shape; these check that the run
can work on the executor it will use: this version of Relax has code for
everything it asks for (`unavailable_features`), its engines' GPUs fit its
node groups (`plan.resource_problems`) and each GPU's memory (`memory.memory_problems`), the names it uses exist, the
batch fits the model's context, every media file of its data set decodes
(`_multimodal_problems`), and the executor has what it needs. Every
problem is a `RecipeError` (exit code 2) that says what to change.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from relax_core.config.checks import looks_like_hub_id, reference_problems
from relax_core.config.data import FileData, SyntheticData
from relax_core.config.engines import engine_kind
from relax_core.config.model import HFModel, TinyModel
from relax_core.config.schema import Recipe
from relax_core.data.prompts import MEDIA_TASKS
from relax_core.errors import RecipeError, UserError
from relax_core.launch.memory import memory_problems
from relax_core.launch.plan import resource_problems
from relax_core.models.model_dir import known_config
from relax_core.models.tiny import TEMPLATE_CHARS

# Chat-template tokens around one user turn with the tiny tokenizer (one token per
# character, one per special token): "<|im_start|>user\n" ... "<|im_end|>\n<|im_start|>assistant\n".
_TINY_TEMPLATE_TOKENS = 1 + 5 + 1 + 1 + 1 + 10
_NOT_YET = "is not available in this version of Relax"


def preflight(recipe: Recipe, recipe_path: str | Path, executor) -> None:
    """Every check; `executor` (launch/executors.py) adds its own."""
    raise_if(recipe_problems(recipe) + executor.problems(recipe), recipe_path)


def recipe_problems(recipe: Recipe) -> list[str]:
    """Every check of the recipe and of what it names on this machine, whichever executor runs it: what
    `relax validate` and `relax submit` both refuse (exit 2, nothing written)."""
    # What this version lacks comes first: it is refused on every executor, whatever else is wrong.
    problems = unavailable_features(recipe) + resource_problems(recipe) + reference_problems(recipe)
    problems += _memory_saver_problems(recipe) + _reward_problems(recipe) + _data_problems(recipe)
    problems += _multimodal_problems(recipe) + _context_problems(recipe) + _tokenizer_problems(recipe)
    problems += _remote_code_problems(recipe) + agentic_problems(recipe) + memory_problems(recipe)
    return problems


def raise_if(problems: list[str], recipe_path: str | Path) -> None:
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        raise RecipeError(f"{recipe_path}: cannot run this recipe ({len(problems)} problem(s)); "
                          f"nothing was started\n{lines}")


def agentic_problems(recipe: Recipe) -> list[str]:
    """`rollout.env`: its file imports and its class takes `args`; `rollout.agent`: its folder exists."""
    ro = recipe.rollout
    if ro.env is not None:
        from relax_core.rollout.envs import env_problems

        return env_problems(ro.env)
    if ro.agent is not None and ro.agent.cwd is not None and not Path(ro.agent.cwd).expanduser().is_dir():
        return [f"rollout.agent.cwd: folder '{ro.agent.cwd}' does not exist"]
    return []


def _reward_problems(recipe: Recipe) -> list[str]:
    from relax_core.rewards.registry import RewardPluginError, list_rewards

    try:
        names = list_rewards(recipe.reward.plugin_dirs)
    except RewardPluginError as exc:
        return [f"reward.plugin_dirs: {exc}"]
    problems = [] if recipe.reward.name in names else [
        f"reward.name: no reward called '{recipe.reward.name}' (available: {', '.join(names)})"]
    return problems + _routing_problems(recipe)


def _routing_problems(recipe: Recipe) -> list[str]:
    """`data.reward_key` of a local data file: every reward its rows name exists (a hub data set is
    checked once the run has fetched it, before any engine starts)."""
    data = recipe.data
    if not isinstance(data, FileData) or not data.reward_key or data.source != "file":
        return []
    from relax_core.data.prompts import build_prompt_source
    from relax_core.rewards.hub import check_routes

    try:
        check_routes(build_prompt_source(data).reward_names(), data.reward_key, recipe.reward.plugin_dirs)
    except UserError as exc:
        return [str(exc)]
    return []


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


def _tokenizer_problems(recipe: Recipe) -> list[str]:
    tokenizer = getattr(recipe.model, "tokenizer", None)
    if not tokenizer or looks_like_hub_id(tokenizer) or Path(tokenizer).expanduser().is_dir():
        return []
    return [f"model.tokenizer: '{tokenizer}' is neither a local tokenizer directory nor a hub id like Org/Name"]


def _remote_code_problems(recipe: Recipe) -> list[str]:
    """A local model or tokenizer that ships its own code (`auto_map`) loads only with trust_remote_code."""
    model = recipe.model
    if not isinstance(model, HFModel) or model.trust_remote_code:
        return []
    dirs = {"model.path": (model.path, "config.json"), "model.tokenizer": (model.tokenizer, "tokenizer_config.json")}
    return [f"{field}: '{path}' ships its own code (auto_map in {name}); set model.trust_remote_code=true "
            "if you trust it" for field, (path, name) in dirs.items() if path and "auto_map" in _local_json(path, name)]


def _local_json(folder: str, name: str) -> dict:
    file = Path(folder).expanduser() / name
    return json.loads(file.read_text()) if not looks_like_hub_id(folder) and file.is_file() else {}


def _context_problems(recipe: Recipe) -> list[str]:
    ro, problems = recipe.rollout, []
    limit = model_context_length(recipe)
    if limit and ro.max_prompt_len + ro.max_new_tokens > limit:
        problems.append(
            f"rollout.max_new_tokens: max_prompt_len ({ro.max_prompt_len}) + max_new_tokens ({ro.max_new_tokens}) "
            f"exceeds the model's context of {limit} tokens"
        )
    data = recipe.data
    if isinstance(data, SyntheticData) and data.task in MEDIA_TASKS:
        return problems + _media_task_problems(recipe, data)
    if isinstance(data, SyntheticData) and isinstance(recipe.model, TinyModel):
        missing = sorted(set(data.symbols + ("0123456789+=" if data.task == "add" else "")) -
                         set(recipe.model.alphabet + TEMPLATE_CHARS))
        if missing:
            problems.append(f"model.alphabet: the task uses characters the tokenizer lacks: {''.join(missing)!r}")
        template = _TINY_TEMPLATE_TOKENS if data.apply_chat_template else 0
        longest = template + (2 * data.max_len + 2 if data.task == "add" else data.max_len)
        if longest > ro.max_prompt_len:
            problems.append(f"rollout.max_prompt_len: prompts of the task are up to {longest} tokens; raise it")
    return problems


def _media_model_problems(recipe: Recipe) -> list[str]:
    """Media columns need a model that reads them: Qwen3-VL (images, video) or Qwen3-Omni (also audio), known
    from a tiny model's architecture or a local model directory's config (a hub id is not fetched here)."""
    from relax_core.data.prompts import media_view

    data = media_view(recipe.data)
    if data is None:
        return []
    keys = [k for k in ("image_key", "video_key", "audio_key") if getattr(data, k)]
    problems = []
    kind = _model_family(recipe)
    if isinstance(recipe.data, SyntheticData) or kind is None:
        return problems  # the synthetic media tasks name their own model (_media_task_problems)
    field = "model.architecture" if isinstance(recipe.model, TinyModel) else "model.path"
    if kind == "text":
        problems.append(f"data.{keys[0]}: {field} is a text-only model, which cannot read "
                        f"{' or '.join(k.removesuffix('_key') for k in keys)}; use a Qwen3-VL or Qwen3-Omni "
                        "model (tiny: architecture qwen3_vl or qwen3_omni), or remove the media keys")
    elif kind == "qwen3_vl" and data.audio_key:
        problems.append(f"data.audio_key: {field} is a Qwen3-VL model, which has no audio encoder; use a "
                        "Qwen3-Omni model or remove data.audio_key")
    return problems


def _model_family(recipe: Recipe) -> str | None:
    model = recipe.model
    if isinstance(model, TinyModel):
        return "text" if model.architecture == "qwen3" else model.architecture
    local = Path(model.path).expanduser()
    if looks_like_hub_id(model.path) or not (local / "config.json").is_file():
        return None
    from relax_core.models.multimodal import family

    return family(local)


def _media_task_problems(recipe: Recipe, data: SyntheticData) -> list[str]:
    """`colours` needs a model that sees (Qwen3-VL or the Omni thinker), `tones` one that hears (Omni); a tiny
    model's tokenizer must have every character of the task's questions."""
    from relax_core.data.synthetic_media import COLOUR_PROBLEM, TONE_PROBLEM

    need = ("qwen3_vl", "qwen3_omni") if data.task == "colours" else ("qwen3_omni",)
    model, problems = recipe.model, []
    if isinstance(model, TinyModel):
        if model.architecture not in need:
            problems.append(f"model.architecture: the {data.task} task needs a model with "
                            f"{'vision' if data.task == 'colours' else 'audio'} ({' or '.join(need)}), "
                            f"not {model.architecture}")
        text = COLOUR_PROBLEM if data.task == "colours" else TONE_PROBLEM
        missing = sorted(set(text) - set(model.alphabet + TEMPLATE_CHARS))
        if missing:
            problems.append(f"model.alphabet: the {data.task} task's questions use characters the tokenizer lacks: "
                            f"{''.join(missing)!r}")
    return problems


def unavailable_features(recipe: Recipe) -> list[str]:
    """What the recipe asks for that this version of Relax has no code for (`MISSING`, one line per field),
    and engine arguments the SGLang that would run them does not take (so `relax validate` catches a
    wrong key). Refused by `relax submit` on every executor and by `relax validate`."""
    problems = _engine_problems(recipe) + _media_model_problems(recipe)
    problems += [line for missing in MISSING for line in missing.check(recipe)]
    for name in ("wandb", "clearml"):
        if recipe.logging.uses(name) and importlib.util.find_spec(name) is None:
            problems.append(f"logging.backends: {name} is not installed here: pip install 'relax-rl[{name}]' "
                            f"(-e '.[{name}]' in a checkout), or drop it from the list")
    return problems


@dataclass(frozen=True)
class Missing:
    """A feature a recipe can ask for that this version has no code for. `relax doctor` lists `field` and
    `what`; `check` gives the refusal lines for a recipe that asks for it (none for one that does not)."""

    field: str
    what: str
    check: Callable[[Recipe], list[str]]


def _asked(field: str, what: str, instead: str, asks: Callable[[Recipe], bool]) -> Missing:
    return Missing(field, what, lambda r: [f"{field}: {what} {_NOT_YET}; {instead}"] if asks(r) else [])


def _megatron(recipe: Recipe) -> bool:
    return recipe.train.backend == "megatron"


def _media_data(recipe: Recipe) -> bool:
    from relax_core.data.prompts import media_view

    return media_view(recipe.data) is not None


def _agentic_media_problems(recipe: Recipe) -> list[str]:
    """Multi-turn rollouts are text-only in this version: images that accumulate over turns are not built."""
    ro = recipe.rollout
    if not ro.agentic:
        return []
    field = "rollout.env" if ro.env is not None else "rollout.agent"
    media = (isinstance(recipe.model, TinyModel) and recipe.model.architecture != "qwen3") or \
        (isinstance(recipe.data, SyntheticData) and recipe.data.task in MEDIA_TASKS) or \
        (isinstance(recipe.data, FileData) and any((recipe.data.image_key, recipe.data.video_key,
                                                    recipe.data.audio_key)))
    if media:
        return [f"{field}: multi-turn rollouts with images, video or audio {_NOT_YET} (text models and data only); "
                "drop the media columns, or drop the environment to train single-turn"]
    return []


# What a recipe can ask for that this version has no code for: the one list `unavailable_features` refuses
# from and `relax doctor` shows. The version that builds one deletes its entry.
MISSING = (
    _asked("train.context_parallel", "context parallelism with train.backend=megatron (megatron-core's needs "
           "Transformer Engine's attention)", "set it to 1",
           lambda r: _megatron(r) and r.train.context_parallel > 1),
    _asked("train.sequence_parallel", "Megatron sequence parallelism (it needs Transformer Engine's or Apex's "
           "norms; the backend builds megatron-core's own layers)", "set it to false",
           lambda r: _megatron(r) and r.train.sequence_parallel),
    _asked("algorithm.teacher", "a distillation teacher with train.backend=megatron", "use train.backend=torch",
           lambda r: _megatron(r) and getattr(r.algorithm, "teacher", None) is not None),
    _asked("algorithm.critic", "a critic (value model) on data with media (images, video, audio)",
           "use an algorithm without one (grpo, dapo, ...) or text data",
           lambda r: getattr(r.algorithm, "critic", None) is not None and _media_data(r)),
    Missing("rollout.env", "multi-turn rollouts (rollout.env, rollout.agent) with images, video or audio",
            _agentic_media_problems),
    Missing("model", "train.backend=megatron with models other than Qwen3 and Qwen3-MoE, rope scaling, "
            "sliding-window attention, or MoE layers mixed with dense ones",
            lambda r: _megatron_model_problems(r) if _megatron(r) else []),
)


def _megatron_model_problems(recipe: Recipe) -> list[str]:
    """What the megatron backend does not build of the model (known from a tiny model's architecture or a
    local model directory's config.json; a hub id is checked when the trainer loads it): models other
    than Qwen3 / Qwen3-MoE and, among those, what `train/megatron/model.unsupported` names."""
    train, problems = recipe.train, []
    config = known_config(recipe)
    if config is not None:
        from relax_core.train.megatron.model import Parallel, unsupported

        par = Parallel(train.tensor_parallel, train.pipeline_parallel, train.context_parallel,
                       train.expert_parallel, train.sequence_parallel)
        field = "model.architecture" if isinstance(recipe.model, TinyModel) else "model.path"
        problems += [p.replace("model:", f"{field}:", 1) for p in unsupported(config, par)]
    elif isinstance(recipe.model, TinyModel):
        problems.append(f"model.architecture: {recipe.model.architecture} with train.backend=megatron (it builds "
                        f"Qwen3 and Qwen3-MoE) {_NOT_YET}; use train.backend=torch")
    return problems


def _engine_problems(recipe: Recipe) -> list[str]:
    """`rollout.engine_args`: SGLang server arguments (checked against SGLang's own), none for the cpu engine;
    `rollout.deterministic`: SGLang's deterministic inference (the cpu engine always samples by the seeds)."""
    ro, problems = recipe.rollout, []
    if not engine_kind(ro.engine).server_args:
        if ro.engine_args:
            problems.append("rollout.engine_args: SGLang server arguments, and the cpu engine takes none; leave it "
                            "empty or use rollout.engine=sglang")
        if ro.deterministic:
            problems.append("rollout.deterministic: it turns on SGLang's deterministic inference, and the cpu engine "
                            "always samples by each sample's seed; remove it or use rollout.engine=sglang")
        return problems
    from relax_core.rollout.sglang_engine import engine_args_problems

    return engine_args_problems(ro.engine_args)


def _memory_saver_problems(recipe: Recipe) -> list[str]:
    """Colocate on GPUs: SGLang frees its memory for the trainer only with its memory saver on (without
    it, a release answers 200 and frees nothing, and the trainer runs out of memory)."""
    from relax_core.cluster.placement import engines_share_train_gpus

    if not engine_kind(recipe.rollout.engine).memory_saver or not engines_share_train_gpus(recipe):
        return []
    if recipe.rollout.engine_args.get("enable_memory_saver") is True:
        return []
    return ["rollout.engine_args.enable_memory_saver: colocate on GPUs needs it true (the engines release their "
            "GPU memory while the trainer runs); set it, or give the engines GPUs of their own "
            "(mode=fully_async with a cluster.rollout group)"]


def _data_problems(recipe: Recipe) -> list[str]:
    """A local data file reads as the run reads it (`data/prompts.row_problems`): it parses, holds rows, and
    every row has the prompt and label columns (and text prompts where no chat template makes tokens of
    them). A file this machine cannot see is `reference_problems`' to report; a hub data set not
    downloaded yet is checked as the run loads it."""
    data = recipe.data
    if not isinstance(data, FileData) or data.source != "file" or not Path(data.path).expanduser().is_file():
        return []
    from relax_core.data.prompts import row_problems

    return row_problems(data)


def _multimodal_problems(recipe: Recipe) -> list[str]:
    """Every media value of every row of a data set this machine holds reads and decodes, within the
    recipe's bounds."""
    if not isinstance(recipe.data, FileData):
        return []
    from relax_core.data.prompts import media_problems

    try:
        return media_problems(recipe.data)
    except UserError as exc:  # the data file itself does not parse (`_data_problems` says so too)
        return [] if _data_problems(recipe) else [str(exc)]
