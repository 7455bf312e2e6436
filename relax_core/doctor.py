"""Inspect this machine for `relax doctor`: packages, devices, schedulers, containers.

Package versions come from installed metadata (no import); only the CUDA
check imports torch, and only when torch is installed. What a recipe can ask
for that this version of Relax has no code for is reported from the list the
preflight refuses from (`launch/preflight.MISSING`), whatever is installed: no
package makes it work.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from importlib import metadata
from typing import Any

PACKAGES = {
    "torch": "torch",
    "ray": "ray",
    "transformers": "transformers",
    "transferqueue": "transferqueue",
    "sglang": "sglang",  # rollout.engine: sglang (GPU nodes)
    "megatron-core": "megatron-core",  # train.backend: megatron
}
COMMANDS = ("sbatch", "srun", "squeue", "sacct", "scontrol", "apptainer", "nvidia-smi")

# What each way of running needs, by check name.
EXECUTORS = {
    "local (CPU)": ("torch", "ray", "transformers"),
    "slurm": ("sbatch", "srun", "squeue", "scontrol"),
    "slurm + container": ("sbatch", "srun", "squeue", "scontrol", "apptainer"),
}


def diagnose() -> dict[str, Any]:
    checks = [{"name": "python", "found": True, "detail": platform.python_version()}]
    checks += [_package(name, dist) for name, dist in PACKAGES.items()]
    checks.append(_cuda())
    checks += [_command(name) for name in COMMANDS]
    found = {c["name"] for c in checks if c["found"]}
    executors = {
        name: {"missing": [need for need in needs if need not in found]} for name, needs in EXECUTORS.items()
    }
    from relax_core.launch.preflight import MISSING  # the list relax submit and relax validate refuse from

    missing = {m.field: f"{m.what}: not available in this version of Relax, whatever is installed" for m in MISSING}
    return {"checks": checks, "executors": executors, "not_available": missing}


def _package(name: str, dist: str) -> dict[str, Any]:
    try:
        return {"name": name, "found": True, "detail": metadata.version(dist)}
    except metadata.PackageNotFoundError:
        return {"name": name, "found": False, "detail": f"pip install {dist}"}


def _cuda() -> dict[str, Any]:
    try:
        metadata.version("torch")
    except metadata.PackageNotFoundError:
        return {"name": "cuda", "found": False, "detail": "torch is not installed"}
    import torch

    if not torch.cuda.is_available():
        return {"name": "cuda", "found": False, "detail": f"no CUDA device (torch {torch.__version__})"}
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return {"name": "cuda", "found": True, "detail": f"{torch.cuda.device_count()} x {', '.join(names)}"}


def _command(name: str) -> dict[str, Any]:
    path = shutil.which(name)
    if not path:
        return {"name": name, "found": False, "detail": "not on PATH"}
    return {"name": name, "found": True, "detail": f"{path} {_version(path)}".strip()}


def _version(path: str) -> str:
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (proc.stdout or proc.stderr).strip().splitlines()[0] if (proc.stdout or proc.stderr).strip() else ""
