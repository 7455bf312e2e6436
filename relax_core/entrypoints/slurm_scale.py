"""The batch step of a scale-out job: its nodes join a running run's Ray cluster as rollout nodes.

    python -m relax_core.entrypoints.slurm_scale RUN_DIR --op s1

Started by the run's supervisor (entrypoints/scale_jobs.py) for `relax scale-rollout +N`.
On each of the job's nodes it starts a Ray worker (`relax_core.cluster.node`
with `--scale-op`: the run's token, the `relax_rollout` slots, and the
`relax_scale_<op>` resource the operation's engines ask for), joining the
head that run.json names, each as an `srun --overlap` step logging to
`logs/ray-<node>-<op>.log`. The driver then starts the engines there, gives
them the current weights and only then routes to them (controller/elastic.py).

It ends when a node step ends (its nodes left the run; the driver removes the
engines that were there), or when it is cancelled (`relax scale-rollout -N`
drained its engines first). On Slurm's USR1 before the time limit it writes
`scale/<op>.ending`: the driver removes its engines at the next safe point
and then cancels this job.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from relax_core.cluster.lifetime import Child
from relax_core.entrypoints.slurm_steps import hostnames, srun_command, srun_env
from relax_core.run_requests import SCALE_FOLDER
from relax_core.rundir import RunDir


def main(argv: list[str] | None = None) -> int:
    from relax_core.config import load_recipe
    from relax_core.config.schema import rollout_group_name

    parser = argparse.ArgumentParser(prog="python -m relax_core.entrypoints.slurm_scale")
    parser.add_argument("run_dir")
    parser.add_argument("--op", required=True)
    args = parser.parse_args(argv)
    run = RunDir(Path(args.run_dir).resolve())
    recipe = load_recipe(run.recipe)
    head = run.read_state().get("ray_head")
    if not head:
        print("relax: the run has no Ray head recorded (run.json: ray_head); nothing to join", file=sys.stderr)
        return 1
    group = rollout_group_name(recipe)
    procs: list[Child] = []

    def ending(*_) -> None:  # the time limit is near: the driver takes the engines away first
        (run.path / SCALE_FOLDER / f"{args.op}.ending").write_text(time.strftime("%Y-%m-%dT%H:%M:%S"))

    signal.signal(signal.SIGUSR1, ending)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for index, node in enumerate(hostnames(os.environ["SLURM_JOB_NODELIST"])):
            node_argv = ["relax_core.cluster.node", str(run.path), "--group", group, "--index", str(index),
                         "--head-address", head, "--scale-op", args.op]
            command = srun_command(recipe, run, group, node, f"ray-{node}", node_argv)
            procs.append(Child(command, log=run.logs / f"ray-{node}-{args.op}.log", env=srun_env()))
        while all(proc.poll() is None for proc in procs):
            time.sleep(0.5)
        return 0
    finally:
        for proc in procs:
            proc.stop()


if __name__ == "__main__":
    sys.exit(main())
