"""`relax cancel [RUN]`: stop a run (scancel for Slurm jobs, SIGINT to a local driver)."""

from __future__ import annotations

import typer

from relax_cli.common import out


def cancel(
    run: str = typer.Argument(None, help="Run directory or name (default: the newest run under ./runs)."),
) -> None:
    """Cancel a run. Its latest checkpoint stays usable for a resume."""
    from relax_core.launch.status import cancel_run
    from relax_core.rundir import find_run

    out.print(cancel_run(find_run(run)), markup=False)
