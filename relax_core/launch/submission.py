"""A submission: what `relax submit` hands its executor, and its record in the run directory.

    submit.prepare  -> Submission (recipe, run directory, executor, job script: nothing written yet)
    record(sub)     -> the run directory with the resolved recipe (and job script), before anything starts;
                       each executor's `launch` records first, and `relax submit --dry-run` stops there
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_core.config import Recipe, dump_recipe
from relax_core.launch.executors import Executor
from relax_core.rundir import RunDir


@dataclass
class Submission:
    recipe: Recipe
    recipe_path: Path
    run: RunDir
    executor: Executor
    job_script: str | None = None
    existing: bool = False  # --run-dir names a run that has started before: this submit resumes it
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)  # the safe changes of a resume
    resume_step: int | None = None  # the checkpoint a resume starts from
    hub: dict[str, str] = field(default_factory=dict)  # recipe field -> the folder its hub id was fetched to


def record(sub: Submission) -> None:
    """Create the run directory and write the resolved recipe before anything starts."""
    sub.run.create()
    sub.run.recipe.write_text(dump_recipe(sub.recipe))
    if sub.job_script is not None:
        sub.run.job_script.write_text(sub.job_script)
    sub.run.run_id()
    # error/finished: what an earlier attempt of a resumed run ended with
    sub.run.update_state(name=sub.recipe.name, executor=sub.executor.name, state="pending", error=None, finished=None,
                         hub=sub.hub, checkpoint_dir=str(sub.run.checkpoint_dir(sub.recipe).absolute()),
                         total_steps=sub.recipe.train.steps, submitted=time.strftime("%Y-%m-%dT%H:%M:%S"))
