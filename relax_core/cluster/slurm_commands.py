"""Slurm's commands, as every side of a Relax job uses them: the login node (`relax submit`, `relax status`,
`relax cancel`: launch/slurm.py) and the Slurm job's supervisor on the batch host, which submits the
scale-out jobs (entrypoints/scale_jobs.py). The `#SBATCH` options of a job component, sbatch with Slurm's
refusal explained by the recipe field to change, job states from squeue (then sacct), scancel.

Standard library only: the CLI imports this on the login node.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

from relax_core.config.cluster import NodeGroup
from relax_core.config.schema import Recipe
from relax_core.errors import RecipeError


def sbatch_option(flag: str, value: object) -> str:
    return f"{flag}={shlex.quote(str(value))}"


def gpu_gres(group: NodeGroup) -> str:
    """The group's GPUs per node as a generic resource, `gpu:N` or `gpu:TYPE:N` (what every select plugin
    takes, unlike `--gpus-per-node`, which select/cons_res and select/linear refuse)."""
    return ":".join(["gpu", *([group.gpu_type] if group.gpu_type else []), str(group.gpus_per_node)])


def component_options(recipe: Recipe, group: NodeGroup, nodes: int | None = None) -> list[str]:
    """`#SBATCH` options of one job component: `nodes` (default: the group's) nodes of the group's shape."""
    slurm = recipe.cluster.slurm
    options = [sbatch_option("--nodes", nodes or group.nodes), "--ntasks-per-node=1",
               sbatch_option("--cpus-per-task", group.cpus_per_node)]
    if group.gpus_per_node:
        options.append(sbatch_option("--gres", gpu_gres(group)))
    placement = group.placement(slurm)
    for flag, value in (("--mem", group.mem), ("--partition", placement["partition"]),
                        ("--account", placement["account"]), ("--qos", placement["qos"]),
                        ("--constraint", placement["constraint"])):
        if value:
            options.append(sbatch_option(flag, value))
    options.append(sbatch_option("--time", slurm.time))
    return options + list(slurm.extra_sbatch)



def sbatch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["sbatch", *args], capture_output=True, text=True, timeout=120, env=env)



def explain_sbatch_error(stderr: str, script: Path, recipe: Recipe | None = None) -> str:
    """Slurm's refusal with the recipe field to change: for GPUs, what the group's partition has instead."""
    text = stderr.lower()
    hints = [
        ("invalid partition", "cluster.slurm.partition (or cluster.<group>.partition): Slurm has no such "
                              "partition (sinfo -s lists them)"),
        ("node configuration is not available",
         "cluster.train / cluster.rollout / cluster.reference: more nodes, GPUs, CPUs or memory than the "
         "partition has"),
        ("node count specification invalid",
         "cluster.train.nodes / cluster.rollout.nodes / cluster.reference.nodes: more nodes than the partition has"),
        ("invalid generic resource",
         "cluster.train.gpus_per_node / cluster.rollout.gpus_per_node / cluster.reference.gpus_per_node: "
         "Slurm has no GPUs as generic resources (gres) here"),
        ("invalid account", "cluster.slurm.account (or cluster.<group>.account): Slurm does not know this account"),
        ("invalid qos", "cluster.slurm.qos (or cluster.<group>.qos): Slurm does not know this QOS"),
        ("time limit", "cluster.slurm.time: longer than the partition allows"),
    ]
    hint = next((h for key, h in hints if key in text), "see the job script")
    if recipe is not None and ("node configuration is not available" in text or "generic resource" in text):
        hint = "\n  ".join(gpu_problems(recipe)) or hint
    return f"Slurm would not run {script}: {stderr}\n  {hint}"


def gpu_problems(recipe: Recipe) -> list[str]:
    """What each GPU group asks for that its partition's nodes lack (their gres, `sinfo -o %G`)."""
    cluster, problems = recipe.cluster, []
    default, offered = partition_gpus()
    for name in cluster.groups:
        group = getattr(cluster, name)
        partition = group.placement(cluster.slurm)["partition"] or default
        if not group.gpus_per_node or partition not in offered:
            continue
        where, gpus = f"partition {partition}", offered[partition]
        types = sorted(t for t in gpus if t)
        if not gpus:
            problems.append(f"cluster.{name}.gpus_per_node: {where} has no GPUs (no gpu gres on its nodes); set "
                            f"cluster.{name}.partition to a partition with GPUs (sinfo -o '%P %G' lists them)")
        elif group.gpu_type and group.gpu_type not in gpus:
            have = f"its GPU types are {', '.join(types)}" if types else "its GPUs have no type: drop gpu_type"
            problems.append(f"cluster.{name}.gpu_type: {where} has no GPUs of type {group.gpu_type}; {have}")
        elif group.gpus_per_node > gpus.get(group.gpu_type or "", 0):
            kind = f" of type {group.gpu_type}" if group.gpu_type else ""
            problems.append(f"cluster.{name}.gpus_per_node: {group.gpus_per_node}, but a node of {where} has at "
                            f"most {gpus.get(group.gpu_type or '', 0)} GPUs{kind}")
    return problems


def partition_gpus() -> tuple[str | None, dict[str, dict[str, int]]]:
    """The default partition, and per partition the most GPUs one of its nodes has of each type ("": of any
    type), from `sinfo`; (None, {}) when sinfo fails."""
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%P|%G"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None, {}
    default, found = None, {}
    for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
        partition, _, gres = line.strip().partition("|")
        name = partition.rstrip("*")
        default = name if partition.endswith("*") else default
        gpus = found.setdefault(name, {})
        for entry in re.sub(r"\([^)]*\)", "", gres).split(","):  # gpu:a100:4(S:0-1),gpu:v100:2,...
            parts = entry.split(":")
            if parts[0] != "gpu" or not parts[-1].isdigit():
                continue
            kind, count = (parts[1] if len(parts) == 3 else ""), int(parts[-1])
            for key in {kind, ""}:  # an untyped request takes GPUs of any type
                gpus[key] = max(gpus.get(key, 0), count)
    return default, found


def submit_script(script: Path, env: dict[str, str] | None = None, recipe: Recipe | None = None) -> str:
    proc = sbatch("--parsable", str(script), env=env)
    if proc.returncode != 0:
        raise RecipeError(explain_sbatch_error(proc.stderr.strip(), script, recipe))
    return proc.stdout.strip().split(";")[0]


class SchedulerUnavailable(RuntimeError):
    """`squeue` itself failed (the controller busy, down or timing out): nothing is known about the jobs."""


def scheduler_states(job_ids: list[str]) -> dict[str, str]:
    """Slurm's state (`RUNNING`, `COMPLETED`, ...) of each of `job_ids` that Slurm still knows; a job
    missing from the answer is one Slurm no longer knows (ended long ago, with accounting off).

    One `squeue -h -t all -j IDS -o '%i|%T'` (the plain format every Slurm from 20.11 to 24.11 reads:
    `squeue --json` does not exist before 21.08 and ignores `-j` on 21.08 and 22.05), then `sacct` for the
    jobs the controller has forgotten. A heterogeneous job's components (`123+0`, `123+1`) answer for the
    job `123`, by its component 0. Raises `SchedulerUnavailable` when `squeue` fails, so that a busy
    controller is never taken for jobs that ended."""
    if not job_ids:
        return {}
    argv = ["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", "%i|%T"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SchedulerUnavailable(f"{shlex.join(argv)}: {exc}") from None
    # Asked about jobs it no longer holds only, squeue refuses them all: known, and the answer is "none".
    if proc.returncode != 0 and "invalid job id" not in proc.stderr.lower():
        raise SchedulerUnavailable(f"{shlex.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    states: dict[str, str] = {}
    for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
        job, _, state = line.strip().partition("|")
        leader, _, component = job.partition("+")
        if leader in job_ids and state and (component in ("", "0") or leader not in states):
            states[leader] = state
    missing = [j for j in job_ids if j not in states]
    return states | _sacct_states(missing)


def _sacct_states(job_ids: list[str]) -> dict[str, str]:
    """States from accounting; nothing where accounting is off or does not answer."""
    if not job_ids:
        return {}
    try:
        proc = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    states = {}
    for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
        job, _, state = line.partition("|")
        states.setdefault(job.split("+")[0], state.split()[0] if state else "")
    return {job: state for job, state in states.items() if job in job_ids}


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], check=True, capture_output=True, text=True, timeout=60)


def slurm_answers() -> bool:
    """`sbatch` is on PATH and a Slurm controller answers (what `cluster.executor: auto` asks)."""
    if not shutil.which("sbatch"):
        return False
    try:
        return subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# Slurm's job states, as Relax reports them.
SLURM_STATES = {
    "PENDING": "pending", "CONFIGURING": "running", "RUNNING": "running", "COMPLETING": "running",
    "REQUEUED": "requeued", "REQUEUE_HOLD": "requeued", "REQUEUE_FED": "requeued", "RESIZING": "running",
    "SUSPENDED": "suspended", "PREEMPTED": "preempted", "COMPLETED": "completed", "CANCELLED": "cancelled",
    "FAILED": "failed", "TIMEOUT": "failed", "NODE_FAIL": "failed", "OUT_OF_MEMORY": "failed",
    "BOOT_FAIL": "failed", "DEADLINE": "failed", "SPECIAL_EXIT": "failed", "REVOKED": "cancelled",
    "RESV_DEL_HOLD": "pending", "STOPPED": "suspended", "SIGNALING": "running", "STAGE_OUT": "running",
}
