"""`relax validate RECIPE [KEY=VALUE ...]`: check a recipe and print it resolved."""

from __future__ import annotations

from pathlib import Path

import typer

from relax_cli.common import err, out


def validate(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    overrides: list[str] = typer.Argument(None, help="Dotted overrides, e.g. train.lr=2e-6 cluster.rollout.nodes=4."),
) -> None:
    """Validate a recipe (with overrides), print the resolved recipe as YAML, and (on stderr) its plan:
    which node group and which GPUs or cores run each process, and the engines' command lines.

    Every check `relax submit` makes of the recipe and of what it names (model and data files, the data's
    rows, rewards, the model's context, the memory plan) is made here by the same code, and refused the
    same way (exit 2). What depends on the executor of this machine (Slurm's partitions, say) is a warning
    here: the recipe may be meant for another cluster.
    """
    from relax_core.config import dump_recipe, load_recipe
    from relax_core.launch.executors import choose_executor, planned_executor
    from relax_core.launch.plan import plan_lines
    from relax_core.launch.preflight import raise_if, recipe_problems

    resolved = load_recipe(recipe, overrides or [])
    raise_if(recipe_problems(resolved), recipe)
    out.print(dump_recipe(resolved), end="", markup=False)
    for line in plan_lines(resolved, planned_executor(resolved)):
        err.print(line, markup=False)
    for problem in _executor_problems(resolved, choose_executor):
        err.print(f"[yellow]warning[/]: {problem}")
    err.print(f"[green]ok[/]: {recipe} is a valid recipe ({resolved.mode}, {resolved.train.backend} trainer, "
              f"{resolved.rollout.engine} engine)")


def _executor_problems(recipe, choose_executor) -> list[str]:
    """What `relax submit` would refuse on this machine's executor; a recipe whose executor this machine
    cannot choose (no Slurm here) says so as one problem."""
    from relax_core.errors import UserError

    try:
        return choose_executor(recipe).problems(recipe)
    except UserError as exc:
        return [str(exc)]
