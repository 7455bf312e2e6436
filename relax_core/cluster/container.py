"""Apptainer: the command prefix of every job step (its checks before submission: launch/container.py).

Where this sits: the cluster layer, used on the login node to render the job
script and on the batch host to start each step. With
`cluster.container.image` set, the Slurm launcher runs each `srun` step and the
batch step's own launcher as

    container_prefix(...) + ["python3", "-m", ...]
    = apptainer exec [--nv] --bind SRC[:DST[:OPTS]] ... --env K=V ... IMAGE python3 -m ...

The helpers return argv lists and quote nothing; the template renderer
`shlex.join`s them. launch/container.py's `check_container` runs before anything
is written, so a wrong image path or bind is a `RecipeError` (exit 2) naming the
recipe field.

Environment: `--cleanenv`, so nothing of the host's environment reaches the
steps unless named here: a login shell's or a module's PYTHONPATH, PYTHONHOME,
LD_LIBRARY_PATH or NCCL_* would otherwise reach the image's Python and NCCL.
What the steps do need is set by Slurm on the compute node as each step starts
(SLURM_*, CUDA_VISIBLE_DEVICES), so the step's argv starts with this module
run by the batch step's own interpreter (`python -m relax_core.cluster.container
apptainer exec ...`): it passes the variables `PASSED_ENV` names from the
step's environment in as `APPTAINERENV_NAME` (`SINGULARITYENV_NAME` for
Singularity 3.x, which reads only that prefix; Apptainer reads both) and execs
apptainer. Recipe values go through `--env` (Apptainer 1.0+ and Singularity
3.6+), which wins over both. `PYTHONNOUSERSITE=1` is set by default because
Apptainer binds the host $HOME, and packages in ~/.local would otherwise shadow
the image's. The Ray token is not passed: the steps read it from the run
directory. A site's per-job TMPDIR is not passed either (it is rarely bound);
`RELAX_RAY_TMP` chooses Ray's temp folder.

Binds: the recipe's own (`cluster.container.binds`), then every host path the
recipe names (`recipe_paths`: model, tokenizer, data, environment and agent
code, reward plug-ins, judge model, `checkpoint.dir`, the hub cache), each at
the same path inside, then the run directory. A file is bound through its
folder; a path under another same-path bind is not bound again; a folder the
run writes and that does not exist yet (the checkpoint folder, the hub cache)
is bound through the nearest folder above it that does.

Paths: `~` and `$VAR` in the image path and bind sources are expanded here, on
the login node, and relative ones are made absolute against the directory
`relax submit` runs in; the job then sees exactly the paths that were checked.

Standard library only: the CLI imports this.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from relax_core.errors import RecipeError

if TYPE_CHECKING:
    from relax_core.config.cluster import ContainerConfig
    from relax_core.config.schema import Recipe

log = logging.getLogger(__name__)

APPTAINER_ENV = "RELAX_APPTAINER"
"""Environment variable naming the apptainer command (e.g. `/opt/apptainer/bin/apptainer`)."""
PULLED_SCHEMES = ("docker://", "oras://", "library://")
"""Image URIs apptainer pulls by itself; no local file to check."""
DEFAULT_ENV = {"PYTHONNOUSERSITE": "1"}
"""Set in every container unless the recipe or the launcher sets the key."""
PASSED_ENV = ("SLURM_*", "SLURMD_*", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL",
              "RELAX_*", "HF_*", "HUGGING_FACE_HUB_TOKEN", "WANDB_*")
"""What a step's process reads from the environment Slurm and the launcher give it: Slurm's job, step and node
variables and the GPUs it assigned, Relax's own settings, the hub's (offline mode, token, endpoint) and W&B's."""
BIND_FLAGS = ("ro", "rw")
BIND_KEYED_OPTIONS = ("image-src=", "id=")  # options of a bind whose source is an image file
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Apptainer reads --env and --bind values as CSV: a ',' separates entries, a '"' quotes.
_CSV_SPECIAL = (",", '"', "\n", "\r")


# ------------------------------------------------------------------ render
def apptainer_command() -> list[str]:
    """`$RELAX_APPTAINER` (split like a shell would), else apptainer or singularity from PATH.

    Falls back to `apptainer` when neither is on PATH here: login nodes often
    lack it while compute nodes have it.
    """
    configured = os.environ.get(APPTAINER_ENV, "").strip()
    if configured:
        return shlex.split(configured)
    return [next((name for name in ("apptainer", "singularity") if shutil.which(name)), "apptainer")]


def container_prefix(container: ContainerConfig, *, run_dir: Path, extra_env: dict[str, str] | None = None,
                     gpus: bool, paths: list[Path] = ()) -> list[str]:
    """The argv before the command of a job step; empty when no image is configured.

    Args:
        container: `cluster.container` of the recipe.
        run_dir: the run directory, bound at the same path inside.
        extra_env: variables the launcher needs inside; they win over the recipe's.
        gpus: whether the step's nodes have GPUs (adds `--nv`).
        paths: host paths bound at the same path inside (`bind_sources(recipe_paths(...))`).
    """
    if not container.image:
        return []
    argv = [sys.executable, "-m", __name__, *apptainer_command(), "exec", "--cleanenv"]
    if gpus:
        argv.append("--nv")
    for spec in bind_specs(container.binds, run_dir, paths):
        argv += ["--bind", spec]
    for key, value in container_env(container.env, extra_env).items():
        argv += ["--env", env_flag(key, value)]
    return [*argv, image_ref(container.image)]


def step_prefix(recipe: Recipe, run_dir: Path, *, gpus: bool) -> list[str]:
    """`container_prefix` of a job step of `recipe`: every path the recipe names bound."""
    if not recipe.cluster.container.image:
        return []
    paths = bind_sources(recipe_paths(recipe, run_dir))
    return container_prefix(recipe.cluster.container, run_dir=run_dir, gpus=gpus, paths=paths)


def in_container(argv: list[str], container: ContainerConfig, *, run_dir: Path,
                 extra_env: dict[str, str] | None = None, gpus: bool) -> list[str]:
    """`argv` run inside the container (unchanged when no image is configured)."""
    return container_prefix(container, run_dir=run_dir, extra_env=extra_env, gpus=gpus) + list(argv)


def bind_specs(binds: list[str], run_dir: Path, paths: list[Path] = ()) -> list[str]:
    """The recipe's binds with absolute sources, then `paths` not under one of them, then the run directory."""
    run = str(Path(run_dir).absolute())
    if has_separator(run):
        raise RecipeError(f"logging.run_root: the run directory {run} contains ':' or ',', which apptainer "
                          "--bind cannot express; choose a run_root without them")
    specs = [_absolute_bind(spec) for spec in binds]
    same_path = [spec.split(":")[0] for spec in specs if _same_path(spec)]
    for path in map(str, paths):
        if not any(_under(path, bound) for bound in same_path):
            specs.append(path)
            same_path.append(path)
    # Last, so that a recipe bind of a parent folder cannot cover it.
    return [*specs, run] if run not in specs and f"{run}:{run}" not in specs else specs


def _same_path(spec: str) -> bool:
    parts = spec.split(":")
    return len(parts) == 1 or parts[1] == parts[0]


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def recipe_paths(recipe: Recipe, run_dir: Path | None) -> list[tuple[str, Path, bool]]:
    """Every host path the recipe names: (its field, the absolute path, whether the run only writes it).

    Hub ids (`Org/Name` where no such folder exists) are not paths: `relax submit` fetches them into the
    hub cache, which is listed (with `run_dir` None only when `cluster.hub_cache` names it). Relative
    paths are taken from the current directory, as the job does.
    """
    from relax_core.config.checks import looks_like_hub_id
    from relax_core.models.hub_cache import hub_cache_dir

    read: list[tuple[str, str | None]] = []
    model, data, rollout, reward = recipe.model, recipe.data, recipe.rollout, recipe.reward
    if getattr(model, "source", None) == "hf":
        read += [("model.path", model.path), ("model.tokenizer", model.tokenizer)]
    if getattr(data, "source", None) == "file":
        read.append(("data.path", data.path))
    if rollout.env is not None:
        tools = rollout.env.args.get("tools") if rollout.env.path is None else None
        read += [("rollout.env.path", rollout.env.path), ("rollout.env.args.tools", tools)]
    if rollout.agent is not None:
        read.append(("rollout.agent.cwd", rollout.agent.cwd))
    read += [(f"reward.plugin_dirs[{i}]", folder) for i, folder in enumerate(reward.plugin_dirs)]
    if reward.genrm is not None:
        read.append(("reward.genrm.model", reward.genrm.model))
    found = [(field, Path(expand_path(value)), False) for field, value in read
             if isinstance(value, str) and value and not looks_like_hub_id(value)]
    if recipe.checkpoint.dir:
        found.append(("checkpoint.dir", Path(expand_path(recipe.checkpoint.dir)), True))
    if recipe.cluster.hub_cache or run_dir is not None:
        found.append(("cluster.hub_cache", hub_cache_dir(recipe, run_dir or "."), True))
    return found


def bind_sources(paths: list[tuple[str, Path, bool]]) -> list[Path]:
    """The folders to bind for `recipe_paths`: a file's folder, a written folder's nearest existing one,
    each once, parents before what they hold."""
    sources = set()
    for _, path, written in paths:
        if written:
            path = next((p for p in (path, *path.parents) if p.exists()), path)
        sources.add(path if path.is_dir() or not path.exists() else path.parent)
    sources.discard(Path("/"))  # never the whole host: check_container refuses such a path first
    return sorted(sources, key=lambda p: (len(p.parts), str(p)))


def container_env(configured: dict[str, str], extra_env: dict[str, str] | None) -> dict[str, str]:
    """Defaults < recipe (`cluster.container.env`) < launcher."""
    return {**DEFAULT_ENV, **configured, **(extra_env or {})}


def env_flag(key: str, value: str) -> str:
    """The value of one `--env`: `K=V`, CSV-quoted when V holds a ',' (else apptainer splits it)."""
    pair = f"{key}={value}"
    if any(ch in value for ch in _CSV_SPECIAL):
        return '"' + pair.replace('"', '""') + '"'
    return pair


def image_ref(image: str) -> str:
    """A pulled URI as is; a local image as an absolute path."""
    return image if uri_scheme(image) else expand_path(image)


def _absolute_bind(spec: str) -> str:
    source, *rest = spec.split(":")
    return ":".join([expand_path(source), *rest])


def expand_path(path: str) -> str:
    return os.path.abspath(os.path.expanduser(os.path.expandvars(path)))


def uri_scheme(image: str) -> str | None:
    return image.split("://", 1)[0] + "://" if "://" in image else None


def has_separator(path: str) -> bool:
    return ":" in path or "," in path


def passed_env(environ: dict[str, str], argv: list[str]) -> dict[str, str]:
    """What the step passes in: each `PASSED_ENV` variable of `environ` that no `--env` of `argv` sets, as
    `APPTAINERENV_NAME` (`SINGULARITYENV_NAME` when the command is `singularity`)."""
    prefix = "SINGULARITYENV_" if Path(argv[0]).name == "singularity" else "APPTAINERENV_"
    explicit = {next(_csv_fields(argv[i + 1]), "").split("=", 1)[0] for i, a in enumerate(argv[:-1]) if a == "--env"}
    return {prefix + key: value for key, value in environ.items()
            if key not in explicit and any(fnmatch.fnmatchcase(key, pattern) for pattern in PASSED_ENV)}


def _csv_fields(value: str):
    import csv

    return iter(next(csv.reader([value]), []))


def main(argv: list[str] | None = None) -> None:
    """`python -m relax_core.cluster.container APPTAINER exec ... IMAGE COMMAND...`: run on the compute node as
    the step starts, it execs apptainer with the step's `PASSED_ENV` variables passed in."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.exit("usage: python -m relax_core.cluster.container APPTAINER exec ... IMAGE COMMAND...")
    os.execvpe(argv[0], argv, {**os.environ, **passed_env(dict(os.environ), argv)})


if __name__ == "__main__":
    main()
