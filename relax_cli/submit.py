"""`relax submit RECIPE [KEY=VALUE ...]`: check a recipe, record it, and run it."""

from __future__ import annotations

from pathlib import Path

import typer

from relax_cli.common import out


def submit(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    overrides: list[str] = typer.Argument(None, help="Dotted overrides, e.g. train.lr=2e-6."),
    executor: str = typer.Option(None, "--executor", "-e", help="auto, slurm or local (default: the recipe's)."),
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="Check all, start nothing; record a new run, leave an existing run alone."),
    run_dir: Path = typer.Option(None, "--run-dir",
                                 help="Run directory; an existing one resumes from its latest checkpoint "
                                      "(only changes that keep it the same run are accepted)."),
) -> None:
    """Run a recipe: locally on this machine, or as a Slurm job."""
    from relax_core.launch.plan import plan_lines
    from relax_core.launch.submission import record
    from relax_core.launch.submit import dry_run_plan, fetch, prepare

    sub = prepare(recipe, overrides or [], executor, run_dir)
    if dry_run:
        if not sub.existing:  # a dry run never writes into an existing run
            record(sub)
            sub.run.update_state(state="dry-run")
        if sub.job_script is not None:
            out.print(sub.job_script, markup=False, end="")
        out.print(f"run directory: {sub.run.path}", markup=False)
        for line in plan_lines(sub.recipe, sub.executor.name, run_dir=str(sub.run.path)) + dry_run_plan(sub):
            out.print(line, markup=False)
        return
    fetch(sub, lambda line: out.print(line, markup=False))
    out.print(f"run directory: {sub.run.path}", markup=False)
    launched = sub.executor.launch(sub, out)
    if launched.outcome == "stopped":  # preempted after checkpointing its last completed step
        out.print(f"[yellow]stopped[/]: {launched.message}")
        raise typer.Exit(3)
    if launched.outcome == "completed":
        out.print(f"[green]done[/]: {launched.message}")
    else:
        out.print(launched.message, markup=False)
