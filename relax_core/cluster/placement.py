"""Where each process of a run goes, computed from the recipe alone: one home that the runtime places by
and `relax validate`'s plan (launch/plan.py) shows.

    GPUs       trainer_gpu, engine_slot_gpus, engine_slots, engines_per_node, engines_share_train_gpus,
               judge_slots and policy_engine_slots (GPU judge engines take the engines' group's last slots)
    cores      threads_per_process (torch threads per process on a node), local_cpu_sets (each node group's
               cores on one machine)
    local Ray  local_slots (the custom resources of the local executor's one node), local_engine_capacity
    Ray        the custom resources' names: TRAIN_RESOURCE, ROLLOUT_RESOURCE, REFERENCE_RESOURCE, JUDGE_RESOURCE,
               scale_resource (a scale-out job's nodes), node_resource (one Slurm node)

A Slurm node's resources are `cluster/node.py`'s `node_resources`, which reads the same functions.
"""

from __future__ import annotations

import math
import os

from relax_core.config.schema import Recipe, rollout_group_name

# Custom Ray resources nodes advertise: training-rank slots, engine slots, reference-worker slots.
TRAIN_RESOURCE, ROLLOUT_RESOURCE, REFERENCE_RESOURCE = "relax_train", "relax_rollout", "relax_reference"
JUDGE_RESOURCE = "relax_judge"  # judge-engine slots (`reward.genrm`), on the engines' group beside its engine slots


def scale_resource(op_id: str) -> str:
    """The resource the nodes of scale-out `op_id`'s job advertise, which only its engines ask for
    (controller/elastic.py)."""
    return f"relax_scale_{op_id}"


def node_resource(name: str) -> str:
    """The custom resource that identifies one Slurm node in the Ray cluster."""
    return f"relax_node_{name}"


def engines_share_train_gpus(recipe: Recipe) -> bool:
    """Colocate on GPUs: the engines run on the train group's GPUs, time-shared with the trainer ranks."""
    return (rollout_group_name(recipe) == "train" and recipe.rollout.gpus_per_engine > 0
            and recipe.cluster.train.gpus_per_node > 0)


def engines_per_node(recipe: Recipe) -> int:
    """Engines one node of the engines' group holds: GPU engines as many as their GPUs fit in the node's,
    CPU engines an even share of `rollout.num_engines` (the group's engine slots, cluster/node.py)."""
    group, tp = getattr(recipe.cluster, rollout_group_name(recipe)), recipe.rollout.gpus_per_engine
    if tp:
        return group.gpus_per_node // tp
    return math.ceil(recipe.rollout.num_engines / max(group.nodes, 1))


def trainer_gpu(recipe: Recipe, rank: int) -> tuple[int, int]:
    """(node, GPU) of trainer rank `rank` on a train group with GPUs: node by node, one rank per GPU."""
    return divmod(rank, recipe.cluster.train.gpus_per_node)


def engine_slot_gpus(recipe: Recipe, slot: int) -> tuple[int, list[int]]:
    """(node, GPUs) of GPU engine slot `slot` of the engines' group: node by node, consecutive GPUs."""
    tp = recipe.rollout.gpus_per_engine
    node, k = divmod(slot, engines_per_node(recipe))
    return node, list(range(k * tp, (k + 1) * tp))


def engine_slots(recipe: Recipe) -> int:
    """GPU engine slots of the engines' group (0 for CPU engines, which take no GPU)."""
    if not recipe.rollout.gpus_per_engine:
        return 0
    return getattr(recipe.cluster, rollout_group_name(recipe)).nodes * engines_per_node(recipe)


def judge_slots(recipe: Recipe) -> list[int]:
    """The engine slots of `reward.genrm`'s judge engines when the engines are on GPUs (SGLang): the last
    `genrm.num_engines` slots of the engines' group, one judge engine of `rollout.gpus_per_engine` GPUs in
    each; none for CPU engines (a judge then takes a `JUDGE_RESOURCE` slot and no GPU), nor when the engines
    share the trainer ranks' GPUs (refused: launch/plan.py's `resource_problems`)."""
    slots = engine_slots(recipe)
    if not slots or not recipe.reward.judge_engines or engines_share_train_gpus(recipe):
        return []
    return list(range(max(slots - recipe.reward.judge_engines, 0), slots))


def policy_engine_slots(recipe: Recipe) -> int:
    """GPU engine slots left to the policy's engines, scale-outs included (0 for CPU engines)."""
    return engine_slots(recipe) - len(judge_slots(recipe))


def local_engine_capacity(recipe: Recipe) -> int:
    """Engines a local run holds at once, scale-outs included: its GPU engine slots (less the judge's), or
    (CPU engines) one per core of this machine, at least the recipe's own."""
    if recipe.rollout.gpus_per_engine:
        return policy_engine_slots(recipe)
    return max(recipe.rollout.num_engines, os.cpu_count() or 1)


def threads_per_process(recipe: Recipe, group: str, cores: int) -> int:
    """Torch threads per process: a node's `cores` split between the trainer ranks and engines it hosts.

    Oversubscribed CPU threads make torch an order of magnitude slower, and
    in colocate mode the processes take turns anyway.
    """
    cluster = recipe.cluster
    per_node = {"train": math.ceil(recipe.train_ranks / cluster.train.nodes), "rollout": 0}
    engine_group = rollout_group_name(recipe)
    per_node[engine_group] += math.ceil(recipe.rollout.num_engines / getattr(cluster, engine_group).nodes)
    return max(1, cores // max(per_node.get(group, 1), 1))


def local_slots(recipe: Recipe) -> dict[str, float]:
    """The custom resources of the one local Ray node: every group's slots (as `cluster.node` gives a node)."""
    # GPU engines: the engines' group's GPUs, as a node of it declares them (their placement groups take
    # them all, controller/gpu_slots.py); CPU engines: one slot each, for as many as a scale-out may add
    engine_gpus = recipe.rollout.gpus_per_engine and getattr(recipe.cluster, rollout_group_name(recipe)).gpus_per_node
    slots = {TRAIN_RESOURCE: recipe.train_ranks, ROLLOUT_RESOURCE: engine_gpus or local_engine_capacity(recipe)}
    if recipe.reward.judge_engines:  # the judge's engines (reward.genrm), beside the rollout engines
        slots[JUDGE_RESOURCE] = recipe.reward.judge_engines
    if recipe.cluster.reference.nodes:  # one reference worker: the group's one node (LocalExecutor.problems)
        slots[REFERENCE_RESOURCE] = 1
    return slots


def local_cpu_sets(recipe: Recipe) -> dict[str, list[int]]:
    """On one machine, each node group gets its own cores (`cpus_per_node` each, in het-group order) when
    they fit, so rollout and training of the asynchronous modes do not slow each other down.

    Train and rollout are pinned both or neither (else none are pinned); a reference group gets its own
    cores after theirs only when those fit too, and otherwise shares the machine unpinned.
    """
    cluster, available = recipe.cluster, sorted(os.sched_getaffinity(0))
    wanted = cluster.train.cpus_per_node + (cluster.rollout.cpus_per_node if cluster.rollout.nodes else 0)
    if not cluster.rollout.nodes or wanted > len(available):
        return {}
    train = available[:cluster.train.cpus_per_node]
    sets = {"train": train, "rollout": available[len(train):wanted]}
    reference = available[wanted:wanted + cluster.reference.cpus_per_node]
    if cluster.reference.nodes and len(reference) == cluster.reference.cpus_per_node:
        sets["reference"] = reference
    return sets


def handover_sources(recipe: Recipe, slot: int) -> list[int]:
    """The trainer rank on the GPU of each TP rank of the engine in GPU slot `slot` (`trainer_gpu`'s layout:
    trainer rank r on GPU r % G of node r // G), which hands that TP rank its weights."""
    node, gpus = engine_slot_gpus(recipe, slot)
    return [node * recipe.cluster.train.gpus_per_node + gpu for gpu in gpus]
