"""`relax submit`: from a recipe to a running job, checking everything first.

    prepare()  load + override + validate + preflight   (nothing written yet)
    slurm:     render the job script, `sbatch --test-only` it (still nothing written)
    record()   run directory with the resolved recipe (and job script)   (--dry-run stops here)
    launch     local: the driver runs in this process; slurm: sbatch
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from relax_core.config import Recipe, dump_recipe, load_recipe
from relax_core.launch.preflight import preflight, resolve_executor
from relax_core.launch.rundir import RunDir, new_run_dir


@dataclass
class Submission:
    recipe: Recipe
    recipe_path: Path
    run: RunDir
    executor: str
    job_script: str | None = None


def prepare(recipe_path: str | Path, overrides: list[str], executor: str | None = None,
            run_dir: str | Path | None = None) -> Submission:
    """Everything `submit` checks, without writing anything."""
    if executor:
        overrides = [*overrides, f"cluster.executor={executor}"]
    recipe = load_recipe(recipe_path, overrides)
    chosen = resolve_executor(recipe)
    preflight(recipe, recipe_path, chosen)
    run = RunDir(Path(run_dir).expanduser().resolve()) if run_dir else new_run_dir(recipe.logging.run_root, recipe.name)
    sub = Submission(recipe, Path(recipe_path), run, chosen)
    if chosen == "slurm":
        sub.job_script = _checked_job_script(recipe, run)
    return sub


def _checked_job_script(recipe: Recipe, run: RunDir) -> str:
    """The rendered job script, after Slurm said it could run it (`sbatch --test-only`)."""
    from relax_core.launch.slurm import render_job_script, test_only

    script = render_job_script(recipe, run)
    with tempfile.TemporaryDirectory(prefix="relax-check-") as folder:
        path = Path(folder) / "job.sbatch"
        path.write_text(script)
        test_only(path)
    return script


def record(sub: Submission) -> None:
    """Create the run directory and write the resolved recipe before anything starts."""
    sub.run.create()
    sub.run.recipe.write_text(dump_recipe(sub.recipe))
    if sub.job_script is not None:
        from relax_core.launch.slurm import SCRIPT_NAME

        (sub.run.path / SCRIPT_NAME).write_text(sub.job_script)
    sub.run.update_state(name=sub.recipe.name, executor=sub.executor, state="pending",
                         total_steps=sub.recipe.train.steps, submitted=time.strftime("%Y-%m-%dT%H:%M:%S"))


def launch_slurm(sub: Submission) -> str:
    """Submit the recorded job script; the Ray token is written (0600) before the job can start."""
    from relax_core.cluster.local_ray import token_env
    from relax_core.launch.slurm import SCRIPT_NAME, submit_script

    token_env(sub.run)
    job_id = submit_script(sub.run.path / SCRIPT_NAME)
    sub.run.update_state(job_id=job_id)
    return job_id
