"""`relax submit`: from a recipe to a running job, checking everything first.

    prepare()  load + override + validate + preflight   (nothing written yet)
               --run-dir: new, or an existing run this recipe continues (check_run_dir)
               executor.prepare: e.g. render the job script, `sbatch --test-only` it (still nothing written)
    fetch()    the hub models and data sets the recipe names, into the shared hub cache (launch/hub.py);
               a dry run fetches nothing
    record()   run directory with the resolved recipe (and job script)   (--dry-run stops here;
               launch/submission.py)
    executor.launch: local: the driver runs in this process; slurm: sbatch

The executor (launch/executors.py) is chosen once, here.

A dry run of an existing run writes nothing at all (`dry_run_plan` says what a
real submit would do); a refused submit leaves every file as it was.
"""

from __future__ import annotations

from pathlib import Path

from relax_core.checkpoint.layout import find_latest
from relax_core.checkpoint.owner import check_owner, holds_checkpoints
from relax_core.config import load_recipe
from relax_core.config.same_run import check_same_run, describe, stored_recipe
from relax_core.errors import RecipeError, UserError
from relax_core.launch.executors import choose_executor
from relax_core.launch.preflight import preflight
from relax_core.launch.submission import Submission
from relax_core.rundir import RunDir, in_use_message, lock_holder, new_run_dir


def prepare(recipe_path: str | Path, overrides: list[str], executor: str | None = None,
            run_dir: str | Path | None = None) -> Submission:
    """Everything `submit` checks, without writing anything."""
    if executor:
        overrides = [*overrides, f"cluster.executor={executor}"]
    recipe = load_recipe(recipe_path, overrides)
    executor = choose_executor(recipe)
    preflight(recipe, recipe_path, executor)
    run = RunDir(Path(run_dir).expanduser().resolve()) if run_dir else new_run_dir(recipe.logging.run_root, recipe.name)
    sub = Submission(recipe, Path(recipe_path), run, executor)
    check_run_dir(sub)
    executor.prepare(sub)
    return sub


def check_run_dir(sub: Submission) -> None:
    """What --run-dir may name: a new or empty folder, a dry run's record, or an existing run that
    this recipe continues (same_run.py), driven by nobody now, whose checkpoint directory is its own."""
    run, recipe = sub.run, sub.recipe
    sub.existing = is_existing_run(run)
    if run.path.exists():
        check_not_live(run)
    if sub.existing:
        old = stored_recipe(run.recipe.read_text())
        sub.changes = check_same_run(old, recipe.model_dump(mode="json"), str(run.path))
    elif run.path.is_dir() and not run.recipe.exists() and any(run.path.iterdir()):
        raise UserError(f"--run-dir {run.path} is a folder with files but not a Relax run (no recipe.yaml); "
                        "give a new or empty folder")
    ckpt = run.checkpoint_dir(recipe)
    check_owner(ckpt, run.read_state().get("run_id") if sub.existing else None, run.path)
    sub.resume_step = find_latest(ckpt) if sub.existing else None
    _check_resume_step(sub, ckpt)


def is_existing_run(run: RunDir) -> bool:
    """A run directory some driver has used; a dry run's record alone is not a run yet."""
    if not run.recipe.exists():
        return False
    return run.read_state().get("state") != "dry-run" or run.metrics.exists() or holds_checkpoints(run.checkpoints)


def check_not_live(run: RunDir) -> None:
    """Refuse a run directory whose driver holds its lock, or whose recorded job is still live."""
    from relax_core.launch.executors import executor_named
    from relax_core.launch.status import FINAL_STATES, current_state

    holder = lock_holder(run)
    if holder is not None:
        raise UserError(in_use_message(run, holder))
    state = run.read_state()
    if state.get("state", "dry-run") in (*FINAL_STATES, "dry-run"):
        return
    executor = executor_named(state.get("executor"))
    try:
        status = current_state(state)
    except OSError:  # no Slurm commands on this machine: the lock is the only witness
        return
    if executor is not None and executor.is_live(state, status):
        job = f"Slurm job {state['job_id']}" if state.get("job_id") else f"driver (PID {state.get('pid')})"
        raise UserError(f"run directory {run.path} is in use: its {job} is {status}; wait for it to end "
                        f"or stop it with `relax cancel {run.path}`, or give another --run-dir")


def _check_resume_step(sub: Submission, ckpt: Path) -> None:
    recipe, step = sub.recipe, sub.resume_step
    if sub.existing and step is not None and not recipe.checkpoint.resume:
        raise RecipeError(f"checkpoint.resume is false, but {ckpt} holds this run's checkpoint of step {step}: "
                          "starting over would overwrite it; set checkpoint.resume=true or give a new --run-dir")
    if step is not None and recipe.train.steps < step:
        raise RecipeError(f"train.steps={recipe.train.steps} is below the step this run resumes from ({step}, "
                          f"the latest checkpoint in {ckpt}); set train.steps to {step} or more")


def dry_run_plan(sub: Submission) -> list[str]:
    """What a real submit would do; for an existing run nothing has been written."""
    from relax_core.launch.hub import hub_refs
    from relax_core.models.hub_cache import hub_cache_dir

    name, steps = sub.recipe.name, sub.recipe.train.steps
    cache = hub_cache_dir(sub.recipe, sub.run.path)
    fetches = [f"a submit fetches {ref.field} '{ref.repo_id}' from the hub into {cache} first (fetched nothing now)"
               for ref in hub_refs(sub.recipe)]
    if not sub.existing:
        return [f"dry run: checked and recorded; the {sub.executor.name} executor would start {name}", *fetches]
    start = f"from step {sub.resume_step}" if sub.resume_step else "from the start (no checkpoint yet)"
    state = sub.run.read_state().get("state", "unknown")
    return [f"dry run: {sub.run.path} is an existing run ({state}); checked it and wrote nothing",
            f"a submit would resume it with the {sub.executor.name} executor {start} to step {steps}",
            *([f"  change: {describe(c)}" for c in sub.changes] or ["  the recipe is unchanged"]), *fetches]


def fetch(sub: Submission, say=None) -> None:
    """Download the hub ids the recipe names into the shared cache, here on the login node, before anything
    is recorded: one that cannot be fetched is a `RecipeError` naming its field, and nothing is submitted;
    nor is a recipe whose memory plan, made from the fetched model's config, does not fit its GPUs."""
    from relax_core.launch.hub import fetch_hub
    from relax_core.launch.memory import memory_problems
    from relax_core.launch.preflight import raise_if

    sub.hub = fetch_hub(sub.recipe, sub.run.path, say)
    if "model.path" in sub.hub:  # its config.json is here now: the memory plan it could not make before
        raise_if(memory_problems(sub.recipe, sub.hub["model.path"]), sub.recipe_path)
