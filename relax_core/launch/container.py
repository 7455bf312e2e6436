"""Apptainer: the command prefix of every job step, and the checks run before submission.

Where this sits: the launch layer, on the login node. With
`cluster.container.image` set, the Slurm launcher runs each `srun` step and the
batch step's own launcher as

    container_prefix(...) + ["python3", "-m", ...]
    = apptainer exec [--nv] --bind SRC[:DST[:OPTS]] ... --env K=V ... IMAGE python3 -m ...

The helpers return argv lists and quote nothing; the template renderer
`shlex.join`s them. `check_container` runs before anything is written, so a
wrong image path or bind is a `RecipeError` (exit 2) naming the recipe field.

Environment: the host environment passes into the container (Apptainer's
default; no `--cleanenv`), because Slurm and the launcher set variables at run
time (SLURM_*, CUDA_VISIBLE_DEVICES, RAY_*, RELAX_*) that the process inside
must see. Recipe values go through `--env`, which wins over both the host and
the image. `PYTHONNOUSERSITE=1` is set by default because Apptainer binds the
host $HOME, and packages in ~/.local would otherwise shadow the image's.

Paths: `~` and `$VAR` in the image path and bind sources are expanded here, on
the login node, and relative ones are made absolute against the directory
`relax submit` runs in; the job then sees exactly the paths that were checked.

Standard library only: the CLI imports this.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from relax_core.errors import RecipeError

if TYPE_CHECKING:
    from relax_core.config.schema import ContainerConfig

APPTAINER_ENV = "RELAX_APPTAINER"
"""Environment variable naming the apptainer command (e.g. `/opt/apptainer/bin/apptainer`)."""
PULLED_SCHEMES = ("docker://", "oras://", "library://")
"""Image URIs apptainer pulls by itself; no local file to check."""
DEFAULT_ENV = {"PYTHONNOUSERSITE": "1"}
"""Set in every container unless the recipe or the launcher sets the key."""
BIND_FLAGS = ("ro", "rw")
BIND_KEYED_OPTIONS = ("image-src=", "id=")  # options of a bind whose source is an image file
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
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
                     gpus: bool) -> list[str]:
    """The argv before the command of a job step; empty when no image is configured.

    Args:
        container: `cluster.container` of the recipe.
        run_dir: the run directory, bound at the same path inside.
        extra_env: variables the launcher needs inside; they win over the recipe's.
        gpus: whether the step's nodes have GPUs (adds `--nv`).
    """
    if not container.image:
        return []
    argv = [*apptainer_command(), "exec"]
    if gpus:
        argv.append("--nv")
    for spec in bind_specs(container.binds, run_dir):
        argv += ["--bind", spec]
    for key, value in container_env(container.env, extra_env).items():
        argv += ["--env", env_flag(key, value)]
    return [*argv, image_ref(container.image)]


def in_container(argv: list[str], container: ContainerConfig, *, run_dir: Path,
                 extra_env: dict[str, str] | None = None, gpus: bool) -> list[str]:
    """`argv` run inside the container (unchanged when no image is configured)."""
    return container_prefix(container, run_dir=run_dir, extra_env=extra_env, gpus=gpus) + list(argv)


def bind_specs(binds: list[str], run_dir: Path) -> list[str]:
    """The recipe's binds with absolute sources, then the run directory (same path inside)."""
    run = str(Path(run_dir).absolute())
    if _has_separator(run):
        raise RecipeError(f"logging.run_root: the run directory {run} contains ':' or ',', which apptainer "
                          "--bind cannot express; choose a run_root without them")
    specs = [_absolute_bind(spec) for spec in binds]
    # Last, so that a recipe bind of a parent folder cannot cover it.
    return [*specs, run] if run not in specs and f"{run}:{run}" not in specs else specs


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
    return image if _scheme(image) else _expand(image)


def _absolute_bind(spec: str) -> str:
    source, *rest = spec.split(":")
    return ":".join([_expand(source), *rest])


def _expand(path: str) -> str:
    return os.path.abspath(os.path.expanduser(os.path.expandvars(path)))


def _scheme(image: str) -> str | None:
    return image.split("://", 1)[0] + "://" if "://" in image else None


def _has_separator(path: str) -> bool:
    return ":" in path or "," in path


# ------------------------------------------------------------------ checks
def check_container(container: ContainerConfig, *, field: str = "cluster.container",
                    run_dir: Path | None = None) -> list[str]:
    """Problems the user must fix before submission, each naming its recipe field.

    Nothing is checked when no image is configured (binds and env are then unused).
    """
    if not container.image:
        return []
    problems = image_problems(container.image, f"{field}.image")
    for index, spec in enumerate(container.binds):
        problems += bind_problems(spec, f"{field}.binds[{index}]")
    for key, value in container.env.items():
        problems += env_problems(key, value, f"{field}.env")
    if run_dir is not None and _has_separator(str(Path(run_dir).absolute())):
        problems.append(f"logging.run_root: the run directory {run_dir} contains ':' or ',', "
                        "which apptainer --bind cannot express")
    return problems


def image_problems(image: str, field: str) -> list[str]:
    scheme = _scheme(image)
    if scheme in PULLED_SCHEMES:
        return [] if image[len(scheme):].strip() else [f"{field}: '{image}' names no image after {scheme}"]
    if scheme:
        return [f"{field}: '{image}': {scheme} images are not supported; use a .sif file "
                f"or a {', '.join(PULLED_SCHEMES)} URI"]
    path = Path(_expand(image))
    if not path.exists():
        return [f"{field}: {path} does not exist; build it (see docker/Dockerfile and apptainer/relax.def) "
                "or fix the path"]
    if not path.is_file():
        return [f"{field}: {path} is not a file; give a .sif image (a sandbox folder converts with "
                f"`apptainer build relax.sif {path}`)"]
    if path.suffix != ".sif":
        return [f"{field}: {path} is not a .sif image; convert it with `apptainer build relax.sif {path}`"]
    return []


def bind_problems(spec: str, field: str) -> list[str]:
    parts = spec.split(":")
    if len(parts) > 3 or not all(parts):
        return [f"{field}: '{spec}' is not SRC[:DST[:OPTS]] ({len(parts)} ':'-separated parts, "
                "none may be empty)"]
    source, dest, options = (parts + [None, None])[:3]
    if "," in source or (dest and "," in dest):
        return [f"{field}: '{spec}' has a ',' in a path; apptainer reads ',' as the start of "
                "another bind, so give one bind per list entry"]
    problems = []
    if dest is not None and not dest.startswith("/"):
        problems.append(f"{field}: the destination '{dest}' must be an absolute path inside the container")
    if options is not None:
        problems += _option_problems(options, field)
    if not Path(_expand(source)).exists():
        problems.append(f"{field}: the source {_expand(source)} does not exist on this machine")
    return problems


def _option_problems(options: str, field: str) -> list[str]:
    bad = [o for o in options.split(",") if o not in BIND_FLAGS and not o.startswith(BIND_KEYED_OPTIONS)]
    if not bad:
        return []
    return [f"{field}: unknown bind option(s) {', '.join(bad)} (use ro or rw)"]


def env_problems(key: str, value: str, field: str) -> list[str]:
    if not _ENV_KEY.match(key):
        return [f"{field}: '{key}' is not a valid variable name (letters, digits and _, not starting "
                "with a digit)"]
    if '"' in value or "\n" in value or "\r" in value:
        return [f"{field}.{key}: the value holds a double quote or a line break, which apptainer --env "
                "cannot pass intact"]
    return []
