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

    Paths and names the recipe refers to that this machine cannot see (a data
    file on the cluster's file system, say) are warnings here; `relax submit`
    treats them as errors. What this version of Relax cannot run anywhere (a
    backend not built yet) is an error here too, as in `relax submit`.
    """
    from relax_core.config import dump_recipe, load_recipe
    from relax_core.config.checks import reference_problems
    from relax_core.launch.plan import plan_lines, planned_executor
    from relax_core.launch.preflight import refuse_unavailable

    resolved = load_recipe(recipe, overrides or [])
    refuse_unavailable(resolved, recipe)
    out.print(dump_recipe(resolved), end="", markup=False)
    for line in plan_lines(resolved, planned_executor(resolved)):
        err.print(line, markup=False)
    for problem in reference_problems(resolved):
        err.print(f"[yellow]warning[/]: {problem}")
    err.print(f"[green]ok[/]: {recipe} is a valid recipe ({resolved.mode}, {resolved.train.backend} trainer, "
              f"{resolved.rollout.engine} engine)")
