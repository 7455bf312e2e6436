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

import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_core.cluster.slurm_commands import (
    SLURM_STATES,
    SchedulerUnavailable,
    cancel,
    component_options,
    explain_sbatch_error,
    sbatch,
    sbatch_option,
    scheduler_states,
    slurm_answers,
    submit_script,
)
from relax_core.config.schema import Recipe
from relax_core.errors import RecipeError
from relax_core.launch.executors import Executor, Launched
from relax_core.rundir import JOB_SCRIPT_FILE, RunDir


@dataclass
class Component:
    title: str  # the script's comment above its options
    options: list[str]


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
def test_only(script: Path, recipe: Recipe | None = None) -> None:
    """Ask Slurm whether it could ever run this job; raise `RecipeError` if not."""
    proc = sbatch("--test-only", str(script))
    if proc.returncode != 0:
        raise RecipeError(explain_sbatch_error(proc.stderr.strip(), script, recipe))


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
