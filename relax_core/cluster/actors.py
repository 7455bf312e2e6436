"""The processes Ray places on a node, as the controller, the services and the judge handle them alike:
the address their servers bind to, the cores and the device they run on, how a failure of one is told in
a line, and ending them.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def node_ip() -> str:
    """The address this node's servers bind to: the one the node was started with
    (RELAX_NODE_IP, set by the executor for every Ray node), else Ray's view."""
    if os.environ.get("RELAX_NODE_IP"):
        return os.environ["RELAX_NODE_IP"]
    import ray

    return ray.util.get_node_ip_address()


def node_id() -> str:
    """The Ray node this process runs on (actors expose it so others can be placed beside them)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def pin_process(cpus: list[int]) -> None:
    """Run every thread of this process (and the threads they start later) on `cpus`.

    `sched_setaffinity(0)` would pin only the calling thread; an actor's
    methods may run on other threads of its pool.
    """
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread ended meanwhile
            pass


def accelerator(device: str, field: str) -> str:
    """`cuda` (the GPU Ray gave this actor, which CUDA_VISIBLE_DEVICES makes device 0) or `cpu`, as asked; a
    GPU asked for (the recipe's `field` > 0) on a node whose GPUs torch cannot see is an error naming them."""
    if device != "cuda":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"{field} > 0, but torch sees no GPU on this node "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    torch.cuda.set_device(0)
    return "cuda"


def end_actors(ray, actors: list, what: str, method: str = "stop", timeout_s: float = 30) -> None:
    """Call `method` on every actor (it stops what the actor started), then end their processes now,
    not whenever the handles are collected. Shutting down: a failure is reported, the rest go on."""
    refs = [getattr(actor, method).remote() for actor in actors]
    try:
        ray.get(refs, timeout=timeout_s)
    except Exception as exc:
        log.warning("stopping %d %s failed: %s", len(refs), what, describe(exc))
    for actor in actors:
        ray.kill(actor)


def describe(error: BaseException) -> str:
    """One line for why a request failed (a Ray task's error: what the task raised)."""
    while getattr(error, "cause", None) is not None and error.cause is not error:  # ray.exceptions.RayTaskError
        error = error.cause
    while isinstance(error.__cause__, BaseException) and "WeightSyncError" in type(error).__name__:
        error = error.__cause__
    first = (str(error).splitlines() or [""])[0]
    return first[:300] if isinstance(error, RequestFailed) else f"{type(error).__name__}: {first[:300]}"


class RequestFailed(RuntimeError):
    """A request failed in another process (the rollout service's), described there."""
