"""`relax submit RECIPE [KEY=VALUE ...]`: check a recipe, record it, and run it."""

from __future__ import annotations

from pathlib import Path

import typer

from relax_cli.common import out


def submit(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    overrides: list[str] = typer.Argument(None, help="Dotted overrides, e.g. train.lr=2e-6."),
    executor: str = typer.Option(None, "--executor", "-e", help="auto, slurm or local (default: the recipe's)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check and record the run, start nothing."),
    run_dir: Path = typer.Option(None, "--run-dir", help="Run directory; an existing one resumes from its latest checkpoint."),
) -> None:
    """Run a recipe: locally on this machine, or as a Slurm job."""
    from relax_core.launch.submit import launch_slurm, prepare, record

    sub = prepare(recipe, overrides or [], executor, run_dir)
    record(sub)
    if dry_run:
        sub.run.update_state(state="dry-run")
        if sub.job_script is not None:
            out.print(sub.job_script, markup=False, end="")
        out.print(f"run directory: {sub.run.path}", markup=False)
        out.print(f"dry run: checked and recorded; the {sub.executor} executor would start {sub.recipe.name}",
                  markup=False)
        return
    out.print(f"run directory: {sub.run.path}", markup=False)
    if sub.executor == "slurm":
        job_id = launch_slurm(sub)
        out.print(f"submitted Slurm job {job_id}; follow it with: relax status {sub.run.path}", markup=False)
        return
    from relax_core.launch.local import run_local

    run_local(sub, out)
    out.print(f"[green]done[/]: {sub.run.path}")
