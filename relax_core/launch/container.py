"""Apptainer on the login node: what `relax submit` checks about `cluster.container` before anything is
written (the image, its binds and variables, every path the recipe names, the image's Relax against this
machine's). The prefix the job's steps run under is relax_core/cluster/container.py's.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from relax_core.cluster.container import (
    BIND_FLAGS,
    BIND_KEYED_OPTIONS,
    ENV_KEY,
    PULLED_SCHEMES,
    apptainer_command,
    expand_path,
    has_separator,
    image_ref,
    recipe_paths,
    uri_scheme,
)

if TYPE_CHECKING:
    from relax_core.config.cluster import ContainerConfig
    from relax_core.config.schema import Recipe

log = logging.getLogger(__name__)


def check_container(container: ContainerConfig, *, field: str = "cluster.container",
                    run_dir: Path | None = None, recipe: Recipe | None = None) -> list[str]:
    """Problems the user must fix before submission, each naming its recipe field.

    Nothing is checked when no image is configured (binds and env are then unused). With `recipe`, also
    every path it names (`recipe_paths`) and, when apptainer is on PATH here, the image's Relax
    (`image_match_problems`).
    """
    if not container.image:
        return []
    problems = image_problems(container.image, f"{field}.image")
    for index, spec in enumerate(container.binds):
        problems += bind_problems(spec, f"{field}.binds[{index}]")
    for key, value in container.env.items():
        problems += env_problems(key, value, f"{field}.env")
    if run_dir is not None and has_separator(str(Path(run_dir).absolute())):
        problems.append(f"logging.run_root: the run directory {run_dir} contains ':' or ',', "
                        "which apptainer --bind cannot express")
    if recipe is not None:
        problems += path_problems(recipe_paths(recipe, run_dir))
        if not problems:
            problems += image_match_problems(container.image, f"{field}.image")
    return problems


def path_problems(paths: list[tuple[str, Path, bool]]) -> list[str]:
    """A path the job reads must exist (apptainer cannot bind what does not); one it writes needs a
    folder above it other than /; no path may hold ':' or ','."""
    problems = []
    for field, path, written in paths:
        if has_separator(str(path)):
            problems.append(f"{field}: {path} contains ':' or ',', which apptainer --bind cannot express; "
                            "move it, or bind a folder above it in cluster.container.binds")
        elif not written and not path.exists():
            problems.append(f"{field}: {path} does not exist on this machine, so the container cannot bind it; "
                            "fix the path")
        elif written and not any(p.exists() for p in (path, *path.parents[:-1])):
            problems.append(f"{field}: no folder of {path} exists but /; create {path.parent} first")
    return problems


INFINIBAND = Path("/sys/class/infiniband")
"""Where the kernel lists this machine's InfiniBand (RDMA) devices."""
PROBE_TIMEOUT_S = 180.0
_PROBE = ("import ctypes.util, importlib.metadata as m; print(m.version('relax-rl')); "
          "print(ctypes.util.find_library('ibverbs') or '')")


def probe_image(image: str) -> tuple[str, str | None] | str:
    """(the image's Relax version, its libibverbs or None), from one `apptainer exec` on this machine; or
    why that failed."""
    probe = [*apptainer_command(), "exec", "--cleanenv", image_ref(image), "python3", "-c", _PROBE]
    try:
        proc = subprocess.run(probe, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`{shlex.join(probe[:-2])}` could not run here ({exc})"
    lines = [line.strip() for line in proc.stdout.splitlines()[-2:]]
    if proc.returncode != 0 or len(lines) != 2:
        detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"`{shlex.join(probe[:-2])}` failed here (exit {proc.returncode}: {detail})"
    return lines[0], lines[1] or None


def image_match_problems(image: str, field: str) -> list[str]:
    """On the login node, at submit: the image's Relax must be this machine's (the batch step runs this
    one, the steps the image's). Warns (logging) when that cannot be checked here, and when this machine
    has InfiniBand devices but the image has no libibverbs (NCCL would then use TCP without a word).
    A pulled URI is not checked (apptainer would download it here)."""
    if uri_scheme(image):
        return []
    command = apptainer_command()
    if not shutil.which(command[0]):
        log.warning("%s: %s is not on PATH on this machine, so the image's Relax version and InfiniBand "
                    "libraries were not checked (`relax doctor --slurm` checks them on a compute node)",
                    field, command[0])
        return []
    probe = probe_image(image)
    if isinstance(probe, str):
        log.warning("%s: %s; the image's Relax version was not checked", field, probe)
        return []
    from importlib.metadata import version

    (inside, ibverbs), ours = probe, version("relax-rl")
    problems = [] if inside == ours else [
        f"{field}: the image has Relax {inside}, this machine Relax {ours}; the job's batch step runs this one "
        "and its steps the image's, which must match: rebuild the image from this checkout (docker/Dockerfile, "
        f"then apptainer/relax.def), or install Relax {inside} here (pip install relax-rl=={inside})"]
    devices = sorted(d.name for d in INFINIBAND.iterdir()) if INFINIBAND.is_dir() else []
    if devices and not ibverbs:
        log.warning("%s: this machine has InfiniBand devices (%s) but the image has no libibverbs (rdma-core): "
                    "NCCL would fall back to TCP sockets without a word. Rebuild the image with apptainer/relax.def "
                    "(it installs rdma-core), or bind the host's libibverbs and its providers "
                    "(/etc/libibverbs.d and the libraries it names) in cluster.container.binds",
                    field, ", ".join(devices))
    return problems


def image_problems(image: str, field: str) -> list[str]:
    scheme = uri_scheme(image)
    if scheme in PULLED_SCHEMES:
        return [] if image[len(scheme):].strip() else [f"{field}: '{image}' names no image after {scheme}"]
    if scheme:
        return [f"{field}: '{image}': {scheme} images are not supported; use a .sif file "
                f"or a {', '.join(PULLED_SCHEMES)} URI"]
    path = Path(expand_path(image))
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
    if not Path(expand_path(source)).exists():
        problems.append(f"{field}: the source {expand_path(source)} does not exist on this machine")
    return problems


def _option_problems(options: str, field: str) -> list[str]:
    bad = [o for o in options.split(",") if o not in BIND_FLAGS and not o.startswith(BIND_KEYED_OPTIONS)]
    if not bad:
        return []
    return [f"{field}: unknown bind option(s) {', '.join(bad)} (use ro or rw)"]


def env_problems(key: str, value: str, field: str) -> list[str]:
    if not ENV_KEY.match(key):
        return [f"{field}: '{key}' is not a valid variable name (letters, digits and _, not starting "
                "with a digit)"]
    if '"' in value or "\n" in value or "\r" in value:
        return [f"{field}.{key}: the value holds a double quote or a line break, which apptainer --env "
                "cannot pass intact"]
    return []
