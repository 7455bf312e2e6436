"""The local executor: the whole job on this machine, driver in the foreground.

The driver starts a private Ray cluster, runs the training loop, and records
its state in run.json so `relax status` and `relax logs` work from another
shell. Ctrl-C stops the run cleanly (the latest checkpoint stays usable).
"""

from __future__ import annotations

import os
import time

from relax_core.launch.submit import Submission


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def run_local(sub: Submission, console) -> None:
    from relax_core.controller.driver import run_driver

    run = sub.run
    run.update_state(state="running", pid=os.getpid(), started=_now())
    try:
        run_driver(sub.recipe, run, console)
    except KeyboardInterrupt:
        run.update_state(state="cancelled", finished=_now())
        raise
    except BaseException as exc:
        run.update_state(state="failed", finished=_now(), error=f"{type(exc).__name__}: {exc}")
        raise
    run.update_state(state="completed", finished=_now())
