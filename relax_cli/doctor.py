"""`relax doctor`: what this machine has, and what each executor still needs."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from relax_cli.common import EXIT_RUNTIME_ERROR, err, fail, out


def doctor(
    recipe: Path = typer.Argument(None, help="With --slurm: the recipe whose partition, account, QOS, GPUs, "
                                             "network interface and container the job uses."),
    overrides: list[str] = typer.Argument(None, help="Dotted overrides of the recipe."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a report."),
    slurm: bool = typer.Option(False, "--slurm", help="Run a one-node job and report what a compute node has."),
    timeout: float = typer.Option(600.0, "--timeout", min=10.0, help="With --slurm: seconds to wait for the job."),
) -> None:
    """Report Python, torch/CUDA, Ray, Slurm and Apptainer on this machine, and the backends not built yet;
    with --slurm, what a compute node has (Slurm, GPUs, InfiniBand and limits, network, hub, container)."""
    if slurm:
        return doctor_slurm(recipe, overrides or [], as_json, timeout)
    if recipe is not None:
        fail(f"{recipe}: a recipe is read only with --slurm (relax doctor --slurm {recipe})")
    from relax_core.doctor import diagnose

    report = diagnose()
    if as_json:
        out.print(json.dumps(report, indent=2), markup=False)
        return
    for item in report["checks"]:
        mark = "[green]ok[/]     " if item["found"] else "[yellow]missing[/]"
        out.print(f"{mark} {item['name']:<14} {item['detail']}")
    out.print()
    for name, verdict in report["executors"].items():
        status = "[green]ready[/]" if not verdict["missing"] else f"[red]missing[/] {', '.join(verdict['missing'])}"
        out.print(f"{name:<22} {status}")
    out.print()
    for name, detail in report["not_available"].items():
        out.print(f"[yellow]not yet[/] {name:<24} {detail}")


def doctor_slurm(recipe: Path | None, overrides: list[str], as_json: bool, timeout: float) -> None:
    """`relax doctor --slurm`: exit 0 when the job ran and reported, 1 (with the reason) when it did not."""
    from importlib.metadata import version

    from relax_core.config import load_recipe
    from relax_core.launch.doctor_slurm import run_doctor, table

    loaded = load_recipe(recipe, overrides) if recipe is not None else None
    result = run_doctor(loaded, timeout_s=timeout,
                        on_wait=None if as_json else lambda job, state: err.print(f"job {job}: {state}", markup=False))
    if result.failure is not None:
        fail(result.failure, EXIT_RUNTIME_ERROR)
    if as_json:
        out.print(json.dumps(result.report, indent=2), markup=False)
        return
    for check, finding in table(result, version("relax-rl")):
        out.print(f"{check:<12} {finding}", markup=False)
    out.print(f"(job files: {result.folder})", markup=False)
