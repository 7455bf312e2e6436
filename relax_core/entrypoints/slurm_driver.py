"""The driver step of a Relax Slurm job (node 0 of het group 0, inside the container if any).

    python -m relax_core.entrypoints.slurm_driver RUN_DIR

Waits until every allocated node has joined the job's Ray cluster (each
advertises `relax_node_<name>`), naming the missing nodes after
`cluster.slurm.startup_timeout_s`, then runs the training loop. USR1 (which
the supervisor forwards from Slurm) means: abort the rollout in progress,
checkpoint the last completed step at once (`relax_core.controller.preemption`)
and exit with DRIVER_STOPPED so the job can be requeued.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from relax_core.cluster.local_ray import token_env
from relax_core.cluster.placement import node_resource
from relax_core.entrypoints.slurm_job import DRIVER_COMPLETED, DRIVER_STARTUP_FAILED, DRIVER_STOPPED
from relax_core.rundir import RunDir

log = logging.getLogger("relax_core.entrypoints.slurm_driver")


class StartupError(RuntimeError):
    """The job's Ray cluster did not come up."""


def connect(head: str, namespace: str) -> bool:
    import ray

    from relax_core.cluster.tq_import import WORKER_SETUP

    try:
        ray.init(address=head, log_to_driver=False, configure_logging=False, namespace=namespace,
                 runtime_env=WORKER_SETUP)
        return True
    except (ConnectionError, RuntimeError) as exc:
        log.info("Ray head %s not reachable yet: %s", head, exc)
        return False


def wait_for_nodes(head: str, expected: list[str], timeout_s: float, namespace: str) -> None:
    import ray

    deadline, missing = time.monotonic() + timeout_s, list(expected)
    while time.monotonic() < deadline:
        if ray.is_initialized() or connect(head, namespace):
            joined = {key for node in ray.nodes() if node.get("Alive") for key in node.get("Resources", {})}
            missing = [name for name in expected if node_resource(name) not in joined]
            if not missing:
                log.info("all %d nodes joined at %s; resources: %s", len(expected), head, ray.cluster_resources())
                return
        time.sleep(0.5)
    raise StartupError(f"nodes {', '.join(missing)} did not join the Ray cluster within {timeout_s:.0f}s "
                       f"(cluster.slurm.startup_timeout_s); see their logs: "
                       + ", ".join(f"logs/ray-{name}.log" for name in missing))


def main(argv: list[str] | None = None) -> int:
    from relax_core.config import load_recipe
    from relax_core.controller.driver import run_job, setup_logging
    from relax_core.controller.preemption import stop_on_signals
    from relax_core.controller.scale_out import SlurmScaleOut

    run = RunDir(Path((argv or sys.argv[1:])[0]).resolve())
    os.environ.update(token_env(run))  # before Ray reads its configuration
    recipe = load_recipe(run.recipe)
    setup_logging(run)
    state = run.read_state()
    stop = threading.Event()
    stop_on_signals(stop, (signal.SIGUSR1,))
    expected = [name for group in state["nodes"].values() for name in group]
    try:
        wait_for_nodes(state["ray_head"], expected, recipe.cluster.slurm.startup_timeout_s, run.path.name)
    except StartupError as exc:
        log.error("%s", exc)
        run.update_state(error=str(exc))
        return DRIVER_STARTUP_FAILED
    # After Ray's connect, which installs a TERM handler of its own: unwind, so engines and trainers are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    outcome = run_job(recipe, run, None, stop=stop, scale_out=SlurmScaleOut.for_run(recipe, run))
    return DRIVER_COMPLETED if outcome == "completed" else DRIVER_STOPPED


if __name__ == "__main__":
    sys.exit(main())
