"""Models and data sets from the hub, fetched on the login node (`relax submit`), read offline in the job.

Compute nodes of most clusters have no internet. `relax submit` therefore downloads every hub id the
recipe names into a shared cache (`cluster.hub_cache`, default `hub-cache` beside the run directory,
laid out as `HF_HOME`: the snapshots are under `hub/`) before anything is recorded, and writes the
folder of each into run.json (`hub`: recipe field -> local folder). The job loads those folders
(`models/model_dir.py: with_fetched`); on Slurm every process of it runs with the hub offline
(`models/hub_cache.py: hub_env`, set by the batch step), so nothing on a compute node tries the network.
The local executor fetches and loads the same way, in the environment it was started with. A cached
snapshot is used as is (offline first, so a second submit asks the hub nothing); only what is missing is
fetched; delete a snapshot's folder to fetch it anew.

This module imports nothing heavy (huggingface_hub only inside `fetch_hub`). Where the cache is, and the
job's offline environment, are `models/hub_cache.py`'s (the job reads them, the container code binds it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from relax_core.config.checks import looks_like_hub_id
from relax_core.config.data import FileData
from relax_core.config.model import HFModel
from relax_core.errors import RecipeError
from relax_core.models.hub_cache import hub_cache_dir

# A model repository often holds the same weights in several formats; the trainers and engines read these.
MODEL_IGNORE = ["*.gguf", "*.onnx", "onnx/*", "*.msgpack", "*.h5", "*.tflite", "*.ot", "original/*"]
# What `model.tokenizer` needs of a repository (not its weights); *.py for a tokenizer that ships its own code.
TOKENIZER_ALLOW = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]


@dataclass(frozen=True)
class HubRef:
    """One hub id a recipe names."""

    field: str  # the recipe field, e.g. "model.path"
    repo_id: str
    repo_type: str  # "model" or "dataset"
    allow: tuple[str, ...] | None = None
    ignore: tuple[str, ...] | None = None


def hub_refs(recipe) -> list[HubRef]:
    """Every hub id the recipe names, by field: the model, its tokenizer, the critic's and the teacher's
    models, the judge model, the data set. Local folders and files are not hub ids."""
    from relax_core.data.prompts import split_patterns

    models: list[tuple[str, str | None]] = []
    if isinstance(recipe.model, HFModel):
        models.append(("model.path", recipe.model.path))
    critic, teacher = getattr(recipe.algorithm, "critic", None), getattr(recipe.algorithm, "teacher", None)
    models.append(("algorithm.critic.init_from", critic.init_from if critic is not None else None))
    models.append(("algorithm.teacher.path", teacher.path if teacher is not None else None))
    models.append(("reward.genrm.model", recipe.reward.genrm.model if recipe.reward.genrm is not None else None))
    refs = [HubRef(field, value, "model", ignore=tuple(MODEL_IGNORE))
            for field, value in models if value and looks_like_hub_id(value)]
    tokenizer = recipe.model.tokenizer if isinstance(recipe.model, HFModel) else None
    if tokenizer and looks_like_hub_id(tokenizer):
        refs.append(HubRef("model.tokenizer", tokenizer, "model", allow=tuple(TOKENIZER_ALLOW)))
    data = recipe.data
    if isinstance(data, FileData) and data.source == "hub" and looks_like_hub_id(data.path):
        refs.append(HubRef("data.path", data.path, "dataset", allow=tuple(split_patterns(data.split))))
    return refs


def fetch_hub(recipe, run_dir: str | Path, say=None) -> dict[str, str]:
    """Download what the recipe names from the hub into its cache; the local folder of each field.

    Raises `RecipeError` naming the field and the id when one cannot be fetched (nothing else is written
    then but what was downloaded). `say(line)` reports each id as it is resolved.
    """
    refs = hub_refs(recipe)
    if not refs:
        return {}
    cache = hub_cache_dir(recipe, run_dir)
    try:
        (cache / "hub").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RecipeError(f"cluster.hub_cache: cannot create {cache} ({exc}); name a folder you can write "
                          "that every node sees") from None
    fetched = {}
    for ref in refs:
        folder, cached = _fetch(ref, cache / "hub")
        if ref.repo_type == "dataset":
            _check_split(ref, folder, recipe.data.split)
        fetched[ref.field] = str(folder)
        if say is not None:
            say(f"{ref.field}: {ref.repo_id} {'in the hub cache' if cached else 'fetched'}: {folder}")
    return fetched


def _fetch(ref: HubRef, cache: Path) -> tuple[Path, bool]:
    """The snapshot folder of `ref` in `cache` and whether it was there already (offline first)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    kwargs = dict(repo_type=ref.repo_type, cache_dir=str(cache), allow_patterns=list(ref.allow or []) or None,
                  ignore_patterns=list(ref.ignore or []) or None)
    try:
        return Path(snapshot_download(ref.repo_id, local_files_only=True, **kwargs)), True
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(snapshot_download(ref.repo_id, **kwargs)), False
    except Exception as exc:  # every failure means the same to the user: this id did not come
        raise RecipeError(_fetch_failure(ref, cache.parent, exc)) from None


def _fetch_failure(ref: HubRef, cache: Path, exc: Exception) -> str:
    from huggingface_hub import constants

    what = "data set" if ref.repo_type == "dataset" else "model"
    reason = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
    if constants.HF_HUB_OFFLINE:
        hint = "HF_HUB_OFFLINE is set here and it is not in the cache: unset it on this (login) node to fetch it"
    else:
        hint = (f"check the id and your access to it (a gated or private one needs `hf auth login`), and that "
                f"this node reaches {constants.ENDPOINT}")
    return (f"{ref.field}: could not fetch the hub {what} '{ref.repo_id}' into {cache} ({type(exc).__name__}: "
            f"{reason}); {hint}. Nothing was submitted.")


def _check_split(ref: HubRef, folder: Path, split: str) -> None:
    from relax_core.data.prompts import split_files, split_patterns

    if not split_files(folder, split):
        raise RecipeError(f"data.split: the hub data set '{ref.repo_id}' has no files of split '{split}' "
                          f"(looked for {', '.join(split_patterns(split))}); name one of its splits")
