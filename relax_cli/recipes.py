"""`relax recipes`: the recipes shipped with Relax, one line each."""

from __future__ import annotations

import typer

from relax_cli.common import out


def recipes(paths: bool = typer.Option(False, "--paths", help="Print full paths.")) -> None:
    """List the shipped recipes with a one-line description."""
    from rich.table import Table

    from relax_core.recipes import shipped_recipes

    table = Table(box=None, show_header=True, header_style="bold")
    table.add_column("recipe")
    table.add_column("description")
    for entry in shipped_recipes():
        table.add_row(str(entry.path) if paths else entry.name, entry.description)
    out.print(table)
