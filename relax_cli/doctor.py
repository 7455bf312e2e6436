"""`relax doctor`: what this machine has, and what each executor still needs."""

from __future__ import annotations

import json

import typer

from relax_cli.common import out


def doctor(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a report.")) -> None:
    """Report Python, torch/CUDA, Ray, Slurm and Apptainer on this machine, and the backends not built yet."""
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
