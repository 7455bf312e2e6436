"""The Slurm executor: render the job script, check it, submit it, query it.

When the node groups ask for different nodes (`cluster.slurm.layout`: het, or auto with different shapes),
the job is heterogeneous, one component per group:

    het group 0: training nodes   (node 0 runs the batch step: Ray head + driver)
    het group 1: rollout nodes    (only when cluster.rollout.nodes > 0)
    het group 2: reference nodes  (only when cluster.reference.nodes > 0; fully_async, so after rollout)

Het group i is `recipe.cluster.groups[i]`, here and in the batch step. When they
ask for the same nodes (layout single, or auto), it is one plain job of all
their nodes, which the batch step splits in that order (train's first).

Every value that reaches the script is computed and quoted here; the
template (`templates/job.sbatch.j2`) only lays the lines out. What runs on
the nodes is `relax_core.entrypoints.slurm_job`, a Python module, not shell.
Light imports only: this runs on the login node.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_core.config.cluster import NodeGroup
from relax_core.config.schema import Recipe
from relax_core.errors import RecipeError
from relax_core.launch.executors import Executor, Launched
from relax_core.rundir import JOB_SCRIPT_FILE, RunDir


@dataclass
class Component:
    title: str  # the script's comment above its options
    options: list[str]


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


def job_options(recipe: Recipe, run: RunDir) -> list[str]:
    """Options of the whole job (they go on the first component)."""
    return [
        sbatch_option("--job-name", f"relax-{recipe.name}"),
        sbatch_option("--output", run.logs / "slurm-%j.out"),
        "--open-mode=append",
        # USR1 to the batch step N seconds before the time limit: checkpoint and requeue.
        sbatch_option("--signal", f"B:USR1@{recipe.cluster.slurm.signal_before_end_s}"),
        "--requeue",
    ]


# What the script's comment calls each group's nodes.
ROLES = {"train": "training", "rollout": "rollout", "reference": "reference"}


def components(recipe: Recipe, run: RunDir) -> list[Component]:
    """The job's components: one per node group in het-group order, or one plain job of every group's nodes
    (same shape); the job-wide options go on the first."""
    cluster = recipe.cluster
    groups = [getattr(cluster, name) for name in cluster.groups]
    if cluster.heterogeneous:
        parts = [Component(f"het group {i}: {ROLES[name]} nodes", component_options(recipe, group))
                 for i, (name, group) in enumerate(zip(cluster.groups, groups))]
    elif len(groups) == 1:
        parts = [Component(f"{ROLES[cluster.groups[0]]} nodes", component_options(recipe, groups[0]))]
    else:
        split = ", then ".join(f"{group.nodes} {ROLES[name]}" for name, group in zip(cluster.groups, groups))
        nodes = sum(group.nodes for group in groups)
        parts = [Component(f"one job of {nodes} nodes: {split}", component_options(recipe, groups[0], nodes))]
    parts[0].options[:0] = job_options(recipe, run)
    return parts


def launcher_argv(run: RunDir, python: str | None = None) -> list[str]:
    """The batch step's command: the job supervisor, with this very interpreter.

    The supervisor calls `srun` and `scontrol`, so it runs on the host even when
    the recipe names a container (it wraps the steps it starts); a shared file
    system, as on every HPC cluster, gives the compute nodes this interpreter.
    """
    return [python or sys.executable, "-m", "relax_core.entrypoints.slurm_job", str(run.path)]


def render_job_script(recipe: Recipe, run: RunDir, python: str | None = None) -> str:
    import jinja2

    from relax_core.assets import asset_dir

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(asset_dir("templates")),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True)
    return env.get_template("job.sbatch.j2").render(
        name=recipe.name,
        components=components(recipe, run),
        setup=list(recipe.cluster.slurm.setup),
        run_dir=shlex.quote(str(run.path)),
        launcher=shlex.join(launcher_argv(run, python)),
    )


# ------------------------------------------------------------------ sbatch
def _sbatch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["sbatch", *args], capture_output=True, text=True, timeout=120, env=env)


def test_only(script: Path, recipe: Recipe | None = None) -> None:
    """Ask Slurm whether it could ever run this job; raise `RecipeError` if not."""
    proc = _sbatch("--test-only", str(script))
    if proc.returncode != 0:
        raise RecipeError(explain_sbatch_error(proc.stderr.strip(), script, recipe))


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
    proc = _sbatch("--parsable", str(script), env=env)
    if proc.returncode != 0:
        raise RecipeError(explain_sbatch_error(proc.stderr.strip(), script, recipe))
    return proc.stdout.strip().split(";")[0]


# ------------------------------------------------------------------ queries
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



# ---------------------------------------------------------------- executor
class SlurmExecutor(Executor):
    """The run as one heterogeneous batch job; the login node only checks, records and submits it."""

    name = "slurm"

    def available(self) -> bool:
        return slurm_answers()

    def placement(self, recipe: Recipe) -> tuple[str, list[str]]:
        cluster = recipe.cluster
        if not cluster.heterogeneous:  # cluster.slurm.layout: one plain job, split by node list
            nodes = sum(getattr(cluster, name).nodes for name in cluster.groups)
            return (f"one job of {nodes} node{'s' if nodes != 1 else ''}: "
                    + ", then ".join(f"{getattr(cluster, name).nodes} {name}" for name in cluster.groups), [])
        where = "het group " + ", ".join(f"{i}: {name}" for i, name in enumerate(cluster.groups))
        if cluster.slurm.layout != "auto":
            return where, []
        return where, [f"a het job (cluster.slurm.layout auto), as {'; '.join(cluster.shape_differences())}"]

    def problems(self, recipe: Recipe) -> list[str]:
        from relax_core.launch.container import check_container

        problems = [f"cluster.slurm: '{tool}' is not on PATH (load Slurm's module, or use --executor local)"
                    for tool in ("sbatch", "squeue", "scontrol") if not shutil.which(tool)]
        return problems + check_container(recipe.cluster.container, recipe=recipe)

    def prepare(self, sub) -> None:
        """The rendered job script, once Slurm said it could run it (`sbatch --test-only`)."""
        script = render_job_script(sub.recipe, sub.run)
        with tempfile.TemporaryDirectory(prefix="relax-check-") as folder:
            path = Path(folder) / JOB_SCRIPT_FILE
            path.write_text(script)
            test_only(path, sub.recipe)
        sub.job_script = script

    def launch(self, sub, console) -> Launched:
        """Record the run, write the Ray token (0600) before the job can start, submit the script."""
        from relax_core.cluster.local_ray import token_env
        from relax_core.launch.submission import record

        record(sub)
        token_env(sub.run)
        job_id = submit_script(sub.run.job_script, recipe=sub.recipe)
        sub.run.update_state(job_id=job_id)
        return Launched("submitted", f"submitted Slurm job {job_id}; follow it with: relax status {sub.run.path}")

    def current_state(self, state: dict[str, Any]) -> str:
        """The scheduler's word while it knows the job, else what the run recorded."""
        recorded, job_id = state.get("state", "unknown"), state.get("job_id")
        if not job_id or recorded == "dry-run":
            return recorded
        try:
            slurm = scheduler_states([str(job_id)]).get(str(job_id))
        except SchedulerUnavailable:  # the controller did not answer: what the run recorded, not "died"
            return recorded
        if slurm is None:  # Slurm forgot the job (no accounting): trust the record, unless it claims to be live
            return "died" if recorded in ("pending", "running", "requeued") else recorded
        mapped = SLURM_STATES.get(slurm.upper(), slurm.lower())
        # The job's own record is more precise once it has finished (completed vs requeued).
        return recorded if mapped == "running" and recorded in ("completed", "requeued") else mapped

    def is_live(self, state: dict[str, Any], status: str) -> bool:
        return bool(state.get("job_id")) and super().is_live(state, status)

    def cancel(self, run: RunDir, state: dict[str, Any]) -> str:
        if not state.get("job_id"):
            return super().cancel(run, state)
        # Read by the batch step on scancel's SIGTERM: the user's cancel is never requeued.
        run.update_state(cancel_requested=time.strftime("%Y-%m-%dT%H:%M:%S"))
        cancel(str(state["job_id"]))
        run.update_state(state="cancelled", finished=time.strftime("%Y-%m-%dT%H:%M:%S"))
        return f"cancelled Slurm job {state['job_id']}"
