"""`relax status [RUN] [--json]`: state, step and reward of a run."""

from __future__ import annotations

import json

import typer

from relax_cli.common import out


def status(
    run: str = typer.Argument(None, help="Run directory or name (default: the newest run under ./runs)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show a run's state, step, reward and latest checkpoint."""
    from relax_core.launch.rundir import find_run
    from relax_core.launch.status import run_status

    report = run_status(find_run(run))
    if as_json:
        out.print(json.dumps(report, indent=2), markup=False)
        return
    for key, value in report.items():
        if value is not None:
            out.print(f"{key:<18} {value}", markup=False)
