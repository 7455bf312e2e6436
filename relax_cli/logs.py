"""`relax logs [RUN] [-f]`: print (or follow) a run's driver log."""

from __future__ import annotations

import sys

import typer


def logs(
    run: str = typer.Argument(None, help="Run directory or name (default: the newest run under ./runs)."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing until the run ends."),
    component: str = typer.Option("driver", "--component", "-c", help="Which log: driver, engine-0, ..."),
) -> None:
    """Print a run's log."""
    from relax_core.errors import UserError
    from relax_core.launch.status import follow as follow_lines
    from relax_core.rundir import find_run

    run_dir = find_run(run)
    path = run_dir.logs / f"{component}.log"
    if not follow:
        if not path.exists():
            available = ", ".join(sorted(p.stem for p in run_dir.logs.glob("*.log"))) or "none yet"
            raise UserError(f"{path}: no such log (logs of this run: {available})")
        sys.stdout.write(path.read_text(errors="replace"))
        return
    for chunk in follow_lines(path, run_dir):
        sys.stdout.write(chunk)
        sys.stdout.flush()
