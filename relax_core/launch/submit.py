"""`relax submit`: from a recipe to a running job, checking everything first.

    prepare()  load + override + validate + preflight   (nothing written yet)
    record()   run directory with the resolved recipe    (--dry-run stops here)
    launch     local: the driver runs in this process; slurm: sbatch
"""

from __future__ import annotations

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


def prepare(recipe_path: str | Path, overrides: list[str], executor: str | None = None,
            run_dir: str | Path | None = None) -> Submission:
    """Everything `submit` checks, without writing anything."""
    if executor:
        overrides = [*overrides, f"cluster.executor={executor}"]
    recipe = load_recipe(recipe_path, overrides)
    chosen = resolve_executor(recipe)
    preflight(recipe, recipe_path, chosen)
    run = RunDir(Path(run_dir).expanduser().resolve()) if run_dir else new_run_dir(recipe.logging.run_root, recipe.name)
    return Submission(recipe, Path(recipe_path), run, chosen)


def record(sub: Submission) -> None:
    """Create the run directory and write the resolved recipe before anything starts."""
    sub.run.create()
    sub.run.recipe.write_text(dump_recipe(sub.recipe))
    sub.run.update_state(name=sub.recipe.name, executor=sub.executor, state="pending",
                         total_steps=sub.recipe.train.steps, submitted=time.strftime("%Y-%m-%dT%H:%M:%S"))
