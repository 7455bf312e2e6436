"""The rollout-only Slurm jobs a running job grows onto (`relax scale-rollout +N`).

    driver (controller/scale_out.py)        supervisor (entrypoints/slurm_job.py, on the host)
    --------------------------------        --------------------------------------------------
    ScaleJobRequests.submit(op, nodes)  ->  scale/<op>.submit.json  ->  renders scale/<op>.sbatch, sbatch
                                        <-  scale/<op>.job.json        {"job_id"} or {"error"}; "ended" once
                                                                       Slurm no longer runs it
    ScaleJobRequests.cancel(op)         ->  scale/<op>.cancel       ->  scancel (also every job, at the end)
    scale-out job's batch step (entrypoints/slurm_scale.py), on Slurm's USR1 before its time limit:
                                        ->  scale/<op>.ending          its engines leave at the next safe point

The requests are files in the run directory because the driver may run inside
a container without Slurm's commands, while the supervisor runs on the host.
The files and how they are written: relax_core/run_requests.py.

A scale-out job has one node per engine group (as many engines as one node of
the engines' group holds), the engines' group's shape (CPUs, GPUs, memory),
the run's partition, account, QOS, constraint and container, and no requeue:
the run re-requests its engines when it resumes. It asks for the time the
run's own job has left (`--time`, whole minutes; the run ends its engines with
it anyway), and with `--time-min` for the least worth having, so that backfill
may start it sooner with a shorter limit: `cluster.slurm.signal_before_end_s`
(its engines leave then) plus `MIN_SERVING_S` of serving. When the run's job
has less than that left, nothing is submitted and the operation fails saying
so. The time left is squeue's for the run's job (`%L`, which follows a limit
changed meanwhile), else `SLURM_JOB_END_TIME`; with neither (no limit), the
recipe's `cluster.slurm.time`.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from relax_core.config.schema import Recipe, rollout_group_name
from relax_core.run_requests import SCALE_FOLDER, read_json, write_private
from relax_core.rundir import RunDir

log = logging.getLogger(__name__)
STATE_EVERY_S = 3.0  # how often the supervisor asks Slurm about its scale-out jobs
WARN_EVERY_S = 300.0  # while squeue fails, how often the job's log says so again
MIN_SERVING_S = 600  # the least a scale-out job's engines should serve before its time limit's USR1


def scale_job_options(recipe: Recipe, run: RunDir, op_id: str, nodes: int,
                      time_left_s: float | None = None) -> list[str]:
    """`#SBATCH` options of scale-out `op_id`'s job: `nodes` nodes shaped as the engines' group, for
    `time_left_s` (what the run's job has left; None: the recipe's `cluster.slurm.time`)."""
    from relax_core.cluster.slurm_commands import component_options, sbatch_option

    group = getattr(recipe.cluster, rollout_group_name(recipe)).model_copy(update={"nodes": nodes})
    signal = f"B:USR1@{recipe.cluster.slurm.signal_before_end_s}"
    options = component_options(recipe, group)
    if time_left_s is not None:
        minutes = int(time_left_s // 60)
        least = min(minutes, math.ceil(least_time_s(recipe) / 60))
        options = [o for o in options if not o.startswith("--time=")]
        options += [sbatch_option("--time", minutes), sbatch_option("--time-min", least)]
    return [sbatch_option("--job-name", f"relax-{recipe.name}-{op_id}"),
            sbatch_option("--output", run.logs / "slurm-%j.out"), "--open-mode=append",
            sbatch_option("--signal", signal), "--no-requeue", *options]


def least_time_s(recipe: Recipe) -> int:
    """The shortest time limit a scale-out job is worth having (its `--time-min`)."""
    return recipe.cluster.slurm.signal_before_end_s + MIN_SERVING_S


def slurm_duration_s(text: str) -> float | None:
    """Seconds in squeue's `[D-][HH:]MM:SS`; None for `UNLIMITED`, `NOT_SET` or anything else."""
    days, _, clock = text.strip().rpartition("-")
    parts = clock.split(":")
    if not (days or "0").isdigit() or not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return int(days or 0) * 86400 + seconds


def run_time_left_s() -> float | None:
    """Seconds until the run's own job (this batch step's, SLURM_JOB_ID) reaches its time limit: squeue's
    `%L` for it, else SLURM_JOB_END_TIME; None when neither says (no limit, or not inside a job)."""
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        try:
            proc = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i|%L"], capture_output=True, text=True,
                                  timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            proc = None
        for line in proc.stdout.splitlines() if proc is not None and proc.returncode == 0 else []:
            component, _, left = line.partition("|")
            if component in (job, f"{job}+0"):
                return slurm_duration_s(left)
    end = os.environ.get("SLURM_JOB_END_TIME", "")
    return int(end) - time.time() if end.isdigit() else None


def render_scale_script(recipe: Recipe, run: RunDir, op_id: str, nodes: int, python: str | None = None,
                        time_left_s: float | None = None) -> str:
    import jinja2

    from relax_core.assets import asset_dir

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(asset_dir("templates")),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True)
    launcher = [python or sys.executable, "-m", "relax_core.entrypoints.slurm_scale", str(run.path), "--op", op_id]
    return env.get_template("scale_rollout.sbatch.j2").render(
        name=recipe.name, op=op_id, options=scale_job_options(recipe, run, op_id, nodes, time_left_s),
        setup=list(recipe.cluster.slurm.setup), run_dir=shlex.quote(str(run.path)), launcher=shlex.join(launcher))


def outside_this_job() -> dict[str, str]:
    """The environment for `sbatch` from inside a job: without the job's SLURM_* variables (Slurm's
    configuration aside), which the new job would inherit: its `srun` took it for this het job's step."""
    keep = ("SLURM_CONF",)
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k in keep}


class ScaleJobs:
    """The supervisor's side: carries out the driver's requests (`poll`, every half second), and cancels
    every scale-out job it submitted when the run's job ends (`cancel_all`)."""

    def __init__(self, recipe: Recipe, run: RunDir):
        self.recipe, self.run = recipe, run
        self.folder = run.path / SCALE_FOLDER
        self.jobs: dict[str, str] = {}  # op -> Slurm job id, of the jobs still running
        self._next_state = 0.0
        self._failing_since: float | None = None  # since when squeue fails (None: it answers)
        self._warned = 0.0

    def poll(self) -> None:
        if not self.folder.is_dir():
            return
        for request in sorted(self.folder.glob("*.submit.json")):
            self._submit(request)
        for cancel in sorted(self.folder.glob("*.cancel")):
            op_id = cancel.name.removesuffix(".cancel")
            if op_id in self.jobs:
                self._cancel(op_id)
        if self.jobs and time.monotonic() >= self._next_state:
            self._next_state = time.monotonic() + STATE_EVERY_S
            self._note_ended()

    def _submit(self, request: Path) -> None:
        from relax_core.cluster.slurm_commands import submit_script

        asked = read_json(request)
        request.unlink(missing_ok=True)
        if not asked:
            return
        op_id, nodes = str(asked["op"]), int(asked["nodes"])
        left = run_time_left_s()
        if left is not None and left < least_time_s(self.recipe):
            why = (f"the run's job ends in {max(left, 0) / 60:.0f} min, too soon for a scale-out job: it needs "
                   f"{least_time_s(self.recipe) / 60:.0f} min (cluster.slurm.signal_before_end_s plus "
                   f"{MIN_SERVING_S // 60} min of serving); nothing submitted")
            write_private(self.folder / f"{op_id}.job.json", {"error": why})
            print(f"relax: scale-out {op_id}: {why}", file=sys.stderr, flush=True)
            return
        script = self.folder / f"{op_id}.sbatch"
        try:
            script.write_text(render_scale_script(self.recipe, self.run, op_id, nodes, time_left_s=left))
            job_id = submit_script(script, env=outside_this_job())
        except Exception as exc:  # Slurm's refusal, named for the user
            write_private(self.folder / f"{op_id}.job.json", {"error": f"sbatch refused the scale-out job: {exc}"})
            print(f"relax: scale-out {op_id}: {exc}", file=sys.stderr, flush=True)
            return
        self.jobs[op_id] = job_id
        write_private(self.folder / f"{op_id}.job.json", {"job_id": job_id, "nodes": nodes})
        print(f"relax: scale-out {op_id}: submitted Slurm job {job_id} ({nodes} node(s))", flush=True)

    def _cancel(self, op_id: str) -> None:
        job_id = self.jobs.pop(op_id)
        subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=60)
        self._mark_ended(op_id, "cancelled")
        print(f"relax: scale-out {op_id}: cancelled Slurm job {job_id}", flush=True)

    def _note_ended(self) -> None:
        """Scale-out jobs Slurm no longer runs (time limit, failure, cancelled by hand) are marked ended.
        While `squeue` fails (a busy or restarting controller) every job is kept as it was, to be asked
        about again at the next poll and cancelled at the run's end: a failed query is not an ended job."""
        from relax_core.cluster.slurm_commands import SLURM_STATES, SchedulerUnavailable, scheduler_states

        try:
            states = scheduler_states(list(self.jobs.values()))
        except SchedulerUnavailable as exc:
            self._query_failed(exc)
            return
        if self._failing_since is not None:
            print(f"relax: squeue answers again, after {time.monotonic() - self._failing_since:.0f}s", flush=True)
            self._failing_since = None
        for op_id, job_id in list(self.jobs.items()):
            state = states.get(job_id)
            if state is None or SLURM_STATES.get(state.upper()) not in (None, "pending", "running", "suspended"):
                self.jobs.pop(op_id)
                self._mark_ended(op_id, f"Slurm job {job_id} {state or 'is gone'}".lower())

    def _query_failed(self, exc: Exception) -> None:
        """One line when `squeue` starts failing, then one every `WARN_EVERY_S` while it goes on."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since, self._warned = now, now
            print(f"relax: cannot ask Slurm about the scale-out jobs ({exc}); asking again", file=sys.stderr,
                  flush=True)
        elif now - self._warned >= WARN_EVERY_S:
            self._warned = now
            print(f"relax: squeue still failing after {now - self._failing_since:.0f}s: {exc}", file=sys.stderr,
                  flush=True)

    def _mark_ended(self, op_id: str, how: str) -> None:
        path = self.folder / f"{op_id}.job.json"
        write_private(path, (read_json(path) or {}) | {"ended": how})

    def cancel_all(self) -> None:
        for op_id in list(self.jobs):
            self._cancel(op_id)
