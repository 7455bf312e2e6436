"""Single-node jobs on Slurm through submitit (it does not do het jobs; these need none).

`relax convert-ckpt --slurm` runs the conversion on a compute node, where the
memory and the file system for a large checkpoint are, and waits for it. The
job's files (script, logs, pickled result) go to `<out>.submitit/`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_on_slurm(fn: Callable[..., Any], *args: Any, folder: Path, job_name: str, partition: str | None,
                 account: str | None, time_min: int, cpus: int, mem_gb: int | None, echo=print, **kwargs: Any):
    """Run `fn(*args, **kwargs)` as a one-node Slurm job and return its result (raises its error)."""
    import submitit

    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    params: dict[str, Any] = {"name": job_name, "timeout_min": time_min, "nodes": 1, "tasks_per_node": 1,
                              "cpus_per_task": cpus, "slurm_partition": partition, "slurm_account": account}
    if mem_gb:
        params["mem_gb"] = mem_gb
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    job = executor.submit(fn, *args, **kwargs)
    echo(f"submitted Slurm job {job.job_id}; logs in {folder}")
    return job.result()
