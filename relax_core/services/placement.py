"""Where a service's actors run: a node group's resource, or next to another actor, on given cores.

A service with a node group of its own (`cluster.reference`) asks for that
group's Ray resource, one worker per GPU (or per node of a CPU group), and a
GPU of it. Otherwise it runs on the node of the actor it serves (the rollout
and advantage services next to the first engine) without taking one of that
node's engine or trainer slots: node affinity, no resource. On one machine (local
executor) each group's cores are pinned (`cpu_sets`), and a service shares
its group's cores.
"""

from __future__ import annotations

from typing import Any


def beside(ray, actor) -> dict[str, Any]:
    """Ray actor options placing a new actor on the node where `actor` runs (taking none of its slots)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get(actor.node_id.remote())
    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


def on_group(resource: str, gpus: int = 0) -> dict[str, Any]:
    """Ray actor options taking one slot of a node group's resource (one worker per slot), and `gpus` of its
    node's GPUs (which Ray then names in the actor's CUDA_VISIBLE_DEVICES)."""
    return {"num_cpus": 0, "num_gpus": gpus, "resources": {resource: 1}}

