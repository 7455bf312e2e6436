"""Where a scale-out's engines start: the executor's half of `relax scale-rollout` inside the driver.

    LocalScaleOut   the engines start at once on this machine, up to what it holds
    SlurmScaleOut   each scale-out asks the job's supervisor for a rollout-only Slurm job
                    (relax_core/run_requests.py, entrypoints/scale_jobs.py); its engines wait for that job's
                    nodes to join the run's Ray cluster, and leave when the job ends

The driver's entry point knows its executor and hands `run_job` the matching one
(entrypoints/local_driver.py, entrypoints/slurm_driver.py); elastic.py runs the
scale operations through this interface and never asks which executor it is.
An engine added by URL starts nowhere of ours (elastic.py handles it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from relax_core.cluster.placement import engines_per_node, local_engine_capacity, scale_resource
from relax_core.config.schema import Recipe
from relax_core.run_requests import ScaleJobRequests
from relax_core.rundir import RunDir


@dataclass(frozen=True)
class Pending:
    """What became of a scale-out that waits for its resources: `error` (it failed), `job_id` (the
    scheduler's id, once known), `ready` (its engines can start loading)."""

    error: str | None = None
    job_id: str | None = None
    ready: bool = False


class ScaleOut:
    """The interface (the defaults: engines start at once, nothing to ask for or give back)."""

    name = ""  # the scale operations' `source`, as the API shows it
    queued = False  # a scale-out waits (`pending`) for resources before its engines start

    def refusal(self, serving: int, delta: int) -> str | None:
        """Why `delta` more engines cannot be had beside the `serving` ones (None: they can)."""
        return None

    def submit(self, op_id: str, count: int) -> None:  # noqa: B027 (a hook: local engines need nothing asked)
        """Ask for the resources of scale-out `op_id`'s `count` engines."""

    def spawn_options(self, op_id: str) -> dict[str, Any] | None:
        """The Ray options of an engine of scale-out `op_id` (None: a free slot of the run's own)."""
        return None

    def pending(self, op_id: str) -> Pending:
        """What became of the resources `submit` asked for."""
        return Pending(ready=True)

    def ending(self, op_id: str) -> bool:
        """Whether scale-out `op_id`'s resources are going away (its engines leave at the next safe point)."""
        return False

    def release(self, op_id: str) -> None:  # noqa: B027 (a hook: local engines hold nothing else)
        """Give back scale-out `op_id`'s resources (its engines are gone, or never came)."""


class LocalScaleOut(ScaleOut):
    """Engines start at once on this machine, up to `capacity` at a time."""

    name = "local"

    def __init__(self, capacity: int):
        self.capacity = capacity

    @classmethod
    def for_run(cls, recipe: Recipe, run: RunDir) -> LocalScaleOut:
        return cls(local_engine_capacity(recipe))

    def refusal(self, serving: int, delta: int) -> str | None:
        if serving + delta <= self.capacity:
            return None
        return (f"this machine holds at most {self.capacity} engines (the run has {serving}); "
                "a Slurm run can grow onto new nodes")


class SlurmScaleOut(ScaleOut):
    """Each scale-out is a rollout-only Slurm job of `ceil(count / per_node)` nodes, submitted by the job's
    supervisor; its engines are placed on those nodes (each advertises the operation's Ray resource)."""

    name = "slurm"
    queued = True

    def __init__(self, requests: ScaleJobRequests, per_node: int, gpus_per_engine: int):
        self.requests, self.per_node, self.gpus = requests, per_node, gpus_per_engine

    @classmethod
    def for_run(cls, recipe: Recipe, run: RunDir) -> SlurmScaleOut:
        return cls(ScaleJobRequests(run), engines_per_node(recipe) or 1, recipe.rollout.gpus_per_engine)

    def submit(self, op_id: str, count: int) -> None:
        self.requests.submit(op_id, math.ceil(count / self.per_node))

    def spawn_options(self, op_id: str) -> dict[str, Any]:
        return {"num_cpus": 0, "num_gpus": self.gpus, "resources": {scale_resource(op_id): max(self.gpus, 1)}}

    def pending(self, op_id: str) -> Pending:
        answer = self.requests.result(op_id) or {}
        job_id = str(answer["job_id"]) if answer.get("job_id") else None
        if answer.get("error"):
            return Pending(error=answer["error"], job_id=job_id)
        if answer.get("ended"):
            why = f": {answer['ended']}" if isinstance(answer["ended"], str) else ""
            return Pending(error=f"its Slurm job {job_id} ended before its engines were up{why}", job_id=job_id)
        return Pending(job_id=job_id, ready=_nodes_joined(op_id))

    def ending(self, op_id: str) -> bool:
        return self.requests.ending(op_id) or bool((self.requests.result(op_id) or {}).get("ended"))

    def release(self, op_id: str) -> None:
        self.requests.cancel(op_id)


def _nodes_joined(op_id: str) -> bool:
    import ray

    want = scale_resource(op_id)
    return any(n.get("Alive") and want in n.get("Resources", {}) for n in ray.nodes())
