"""`relax plot [RUN] [--out FILE]`: a run's training curves as one image."""

from __future__ import annotations

from pathlib import Path

import typer

from relax_cli.common import out


def plot(
    run: str = typer.Argument(None, help="Run directory or name (default: the newest run under ./runs)."),
    out_file: Path = typer.Option(None, "--out", "-o",
                                  help="Image to write (.png, .pdf or .svg; default: RUN/curves.png)."),
) -> None:
    """Draw reward, response length, throughput, staleness, losses and step time against steps."""
    from relax_core.metrics.plot import plot_run
    from relax_core.rundir import find_run

    run_dir = find_run(run)
    written = plot_run(run_dir.metrics, out_file or run_dir.path / "curves.png", title=run_dir.path.name)
    out.print(f"wrote {written}", markup=False)
