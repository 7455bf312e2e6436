"""The local executor: the whole job on this machine, driver in the foreground.

The driver starts a private Ray cluster, runs the training loop, and records
its state in run.json so `relax status` and `relax logs` work from another
shell. Ctrl-C stops the run cleanly (the latest checkpoint stays usable);
USR1 or TERM stop it within seconds after checkpointing the last completed
step (state `preempted`; submitting the run again resumes it).
The driver holds the run directory's lock (`DriverLock`) from before it
records the recipe until it has stopped everything, so a second driver of the
same run is refused, naming this one's host and PID.
"""

from __future__ import annotations

import os
import signal
import socket
import time

from relax_core.launch.executors import Executor, Launched
from relax_core.launch.status import pid_alive
from relax_core.launch.submission import Submission, record
from relax_core.rundir import DriverLock


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def run_local(sub: Submission, console) -> str:
    """Run the job in this process; returns "completed", or "stopped" (USR1/TERM, checkpointed)."""
    from relax_core.entrypoints.local_driver import run_driver

    run = sub.run
    # Ctrl-C and `relax cancel` (SIGINT) stop the run, also when a shell started it in the background,
    # which leaves SIGINT ignored (and then Python installs no KeyboardInterrupt handler of its own).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with DriverLock(run):
        record(sub)
        run.update_state(state="running", pid=os.getpid(), host=socket.gethostname(), started=_now())
        try:
            outcome = run_driver(sub.recipe, run, console)
        except KeyboardInterrupt:
            run.update_state(state="cancelled", finished=_now())
            raise
        except BaseException as exc:
            run.update_state(state="failed", finished=_now(), error=f"{type(exc).__name__}: {exc}")
            raise
        # "stopped": USR1 or TERM ended the run after checkpointing its last completed step
        run.update_state(state="completed" if outcome == "completed" else "preempted", finished=_now())
        return outcome


class LocalExecutor(Executor):
    """The whole run on this machine, its driver in this process."""

    name = "local"
    on_this_machine = True

    def placement(self, recipe) -> tuple[str, list[str]]:
        return "every node group on this machine", []

    def problems(self, recipe) -> list[str]:
        return [f"cluster.{group}.nodes: the local executor runs each node group on this one machine; "
                "use 1 node (or Slurm)" for group in recipe.cluster.groups if getattr(recipe.cluster, group).nodes > 1]

    def launch(self, sub: Submission, console) -> Launched:
        if run_local(sub, console) == "stopped":  # USR1 or TERM: the last completed step is checkpointed
            return Launched("stopped", f"{sub.run.path}; the same command resumes it")
        return Launched("completed", str(sub.run.path))

    def current_state(self, state: dict) -> str:
        """A run marked running whose driver is gone has died."""
        recorded = state.get("state", "unknown")
        return "died" if recorded == "running" and not pid_alive(state.get("pid")) else recorded

    def is_live(self, state: dict, status: str) -> bool:
        return status == "running"

    def cancel(self, run, state: dict) -> str:
        if not pid_alive(state.get("pid")):
            return super().cancel(run, state)
        os.kill(int(state["pid"]), signal.SIGINT)  # the driver stops its engines, trainers and Ray
        return f"sent SIGINT to the local driver (pid {state['pid']})"
