"""`relax status [RUN] [--json]`: state, progress (rate, ETA), reward trend, staleness, engines (whether they
answer now, their weight version and requests running + waiting, PIDs, restarts), trainer ranks (PIDs), job
restarts and latest checkpoint of a run."""

from __future__ import annotations

import json

import typer

from relax_cli.common import out


def status(
    run: str = typer.Argument(None, help="Run directory or name (default: the newest run under ./runs)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show a run's state, step, reward and latest checkpoint."""
    from relax_core.launch.status import run_status
    from relax_core.rundir import find_run

    report = run_status(find_run(run))
    if as_json:
        out.print(json.dumps(report, indent=2), markup=False)
        return
    engines, scale, trainers = report.pop("engines"), report.pop("scale"), report.pop("trainers")
    if report.get("eta_s") is not None:
        report["eta_s"] = f"{report['eta_s']}s ({_clock(report['eta_s'])})"
    for key, value in report.items():
        if value is not None:
            out.print(f"{key:<18} {value}", markup=False)
    for engine in engines or []:
        where = f" on {engine['node']}" if engine.get("node") else ""
        health = {True: "healthy", False: "NOT ANSWERING", None: "-"}[engine.get("healthy")]
        out.print(f"{'engine ' + engine['id']:<18} {engine['state']:<9} {engine['origin']:<9} {health:<13} "
                  f"pid {engine.get('pid') or '-'} restarts {engine.get('restarts', 0)} {_live(engine)}"
                  f"{engine.get('url') or '-'}{where}", markup=False)
    for rank in trainers or []:
        out.print(f"{'trainer rank ' + str(rank['rank']):<18} pid {rank['pid']} on {rank['node']}", markup=False)
    if scale:
        job = f", Slurm job {scale['slurm_job_id']}" if scale.get("slurm_job_id") else ""
        error = f": {scale['error']}" if scale.get("error") else ""
        out.print(f"{'scale ' + scale['id']:<18} {scale['kind']} {scale['count']} ({scale['source']}{job}) "
                  f"{scale['state']}{error}", markup=False)


def _live(engine: dict) -> str:
    """The engine's weight version and requests (running + waiting), as it reported them now."""
    version, load = engine.get("weight_version"), engine.get("load")
    shown = f"weights v{version} " if version is not None else ""
    if load is not None:
        shown += f"requests {load['num_running_reqs']}+{load['num_waiting_reqs']} "
    return shown


def _clock(seconds: float) -> str:
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
