"""Where a run's driver runs: one `Executor` per scheduler, chosen once per command.

    LocalExecutor  (launch/local.py)  the driver in this process, a private Ray cluster on this machine
    SlurmExecutor  (launch/slurm.py)  a heterogeneous batch job whose batch step starts Ray and the driver

`relax submit` asks the chosen executor for its own checks (`problems`), for
what it will submit (`prepare`: nothing written) and to start the run
(`launch`); `relax validate` for where its node groups run (`on_this_machine`,
`placement`); `relax status` and `relax cancel` ask the executor that run.json
names. Inside the job, the driver's entry point hands the controller the
executor's part of `relax scale-rollout` (controller/scale_out.py). Nothing
outside these classes branches on an executor's name (tests/unit/test_one_home.py).
Light imports only: the CLI uses this on the login node.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from relax_core.errors import UserError

# name -> "module:class", imported when asked for (the Slurm executor needs no torch, the local one no Slurm)
_EXECUTORS = {
    "local": "relax_core.launch.local:LocalExecutor",
    "slurm": "relax_core.launch.slurm:SlurmExecutor",
}
_AUTO = ("slurm", "local")  # what `cluster.executor: auto` picks: the first one `available` here


@dataclass(frozen=True)
class Launched:
    """What `launch` did: `outcome` is "completed", "stopped" (preempted, checkpointed) or "submitted"."""

    outcome: str
    message: str


class Executor(ABC):
    """The interface; the defaults suit an executor that has nothing to add at that point."""

    name = ""
    on_this_machine = False  # every node group is a share of this machine (each pinned to its own cores)

    def placement(self, recipe) -> tuple[str, list[str]]:
        """Where the recipe's node groups run, as the plan says it: a few words, and notes below them."""
        return "", []

    def available(self) -> bool:
        """Whether this machine can run it (what `cluster.executor: auto` asks)."""
        return True

    def problems(self, recipe) -> list[str]:
        """What this executor cannot run in the recipe, one line per field (exit 2 before anything is written)."""
        return []

    def prepare(self, sub) -> None:  # noqa: B027 (a hook: most executors hand over nothing to check)
        """Build and check what `launch` will hand over (a job script), writing nothing."""

    @abstractmethod
    def launch(self, sub, console) -> Launched:
        """Start the recorded run: drive it here to its end, or hand it to a scheduler."""

    def current_state(self, state: dict[str, Any]) -> str:
        """The run's state as this executor sees it (run.json's record is the fallback)."""
        return state.get("state", "unknown")

    def is_live(self, state: dict[str, Any], status: str) -> bool:
        """Whether the run still has a driver or job that owns its directory."""
        return status in ("running", "pending", "requeued", "suspended")

    def cancel(self, run, state: dict[str, Any]) -> str:
        raise UserError(f"{run.path}: the run has no live job or driver to cancel")


def executor_named(name: str | None) -> Executor | None:
    """The executor called `name` (as run.json records it); None for an unknown or missing name."""
    if name not in _EXECUTORS:
        return None
    module, _, cls = _EXECUTORS[name].partition(":")
    return getattr(importlib.import_module(module), cls)()


def choose_executor(recipe) -> Executor:
    """The recipe's `cluster.executor`; `auto`: the first of `_AUTO` that this machine can run (Slurm when
    `sbatch` is on PATH and a controller answers, else local)."""
    if recipe.cluster.executor == "auto":
        return next(executor for executor in map(executor_named, _AUTO) if executor.available())
    return executor_named(recipe.cluster.executor)


def planned_executor(recipe) -> str:
    """The executor `relax submit` would pick, without asking Slurm (`auto`: slurm when sbatch is on PATH)."""
    if recipe.cluster.executor != "auto":
        return recipe.cluster.executor
    import shutil

    return "slurm" if shutil.which("sbatch") else "local"
