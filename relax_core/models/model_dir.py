"""The model directory every process of a run loads, chosen in one place.

Built (a tiny model), local, or fetched from the hub once; with `model.tokenizer` it is `<run>/model`, the
model's files linked in and the named tokenizer saved in place of the model's own, so the driver, the
engines, the router and the checkpoint's HF copy all load the same tokenizer.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from relax_core.config.checks import looks_like_hub_id
from relax_core.config.model import HFModel, TinyModel
from relax_core.config.schema import Recipe
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


def known_config(recipe: Recipe) -> dict | None:
    """The model's config.json when it is known before the run: a tiny Qwen3's, or a local directory's
    (what `relax submit` checks the model by, before anything is fetched or built)."""
    model = recipe.model
    if isinstance(model, TinyModel):
        if model.architecture != "qwen3":
            return None
        from relax_core.models import tiny

        return tiny.qwen3_config_dict(1, hidden_size=model.hidden_size, num_layers=model.num_layers,
                                      num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                                      intermediate_size=2 * model.hidden_size,
                                      max_position_embeddings=512, eos_token_id=0, pad_token_id=0)
    local = Path(model.path).expanduser()
    if looks_like_hub_id(model.path) or not (local / "config.json").is_file():
        return None
    return json.loads((local / "config.json").read_text())


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
