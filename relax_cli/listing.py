"""`relax list algorithms|rewards [--json]`: the names a recipe accepts."""

from __future__ import annotations

import json
from enum import Enum

import typer

from relax_cli.common import out


class What(str, Enum):
    algorithms = "algorithms"
    rewards = "rewards"


def list_names(
    what: What = typer.Argument(..., help="algorithms or rewards"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    plugin_dirs: list[str] = typer.Option(None, "--plugin-dir", help="Also list rewards of plug-ins in this folder."),
) -> None:
    """List the algorithms or rewards a recipe can name."""
    from relax_core.catalog import algorithm_entries, reward_entries

    entries = algorithm_entries() if what is What.algorithms else reward_entries(plugin_dirs or [])
    if as_json:
        out.print(json.dumps(entries, indent=2), markup=False)
        return
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for column in ("name", "description", "parameters"):
        table.add_column(column)
    for entry in entries:
        params = ", ".join(f"{k}={v}" for k, v in entry.get("parameters", {}).items())
        table.add_row(entry["name"], entry["description"], params)
    out.print(table)
