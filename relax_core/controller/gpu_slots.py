"""What each trainer rank and engine asks Ray for, so that the GPUs a run asks for add up to its groups'.

launch/plan.py says which GPU of which node each process gets; the placement
groups made here hold Ray to it:

    train group with GPUs   one placement group per node (STRICT_PACK), one bundle {GPU: 1, relax_train: 1}
                            per GPU; trainer rank r in bundle r % G of the group of node r // G (G GPUs a node)
    engines on GPUs of a    one placement group per node, one bundle {GPU: t, relax_rollout: t} per engine
    rollout group           slot (t: rollout.gpus_per_engine); the engine takes all of it, so Ray's
                            CUDA_VISIBLE_DEVICES names its t GPUs. The judge engines of reward.genrm take
                            the last slots (placement.judge_slots) the same way
    colocate on GPUs        the engines use the train group's bundles: engine slot s and the trainer rank of
                            its first GPU take half of that bundle's GPU each, and its server runs on the t
                            GPUs of the bundles from there (CUDA_VISIBLE_DEVICES, set by EngineWorker), which
                            a probe task in each bundle reads once. A bundle keeps its one GPU for its life,
                            so trainer rank i and the engine that holds GPU i see the same device
    CPU                     no placement group: the group's slot resource (relax_train / relax_rollout),
                            one a process

Without them, a colocated engine of TP 2 asked for 2 GPUs of its own beside
the trainer ranks' 8 on a node of 8 (16 of 8: never placed).
"""

from __future__ import annotations

from typing import Any

from relax_core.cluster.placement import (
    ROLLOUT_RESOURCE,
    TRAIN_RESOURCE,
    engine_slot_gpus,
    engines_per_node,
    engines_share_train_gpus,
    policy_engine_slots,
    trainer_gpu,
)
from relax_core.config.schema import Recipe, rollout_group_name

SHARE = 0.5  # of a colocated GPU: the trainer rank's half and the engine's half
PLACE_TIMEOUT_S = 120.0  # every node has joined when the driver starts: a group not placed by then never is


class GpuSlots:
    """The placement groups of one run and the Ray options of each trainer rank and engine slot."""

    def __init__(self, ray, recipe: Recipe):
        self._ray, self.recipe = ray, recipe
        self.train_groups: list = []  # one placement group per train node (train group with GPUs)
        self.engine_groups: list = []  # one per engines' node (GPU engines on a rollout group)
        self.colocated_gpus: list[list[str]] = []  # per train node: the GPU id of each bundle (colocate on GPUs)

    @classmethod
    def reserve(cls, ray, recipe: Recipe) -> GpuSlots:
        """Make (and wait for) the placement groups the recipe needs; none on CPU."""
        slots = cls(ray, recipe)
        try:
            slots._reserve()
        except BaseException:
            slots.release()
            raise
        return slots

    def _reserve(self) -> None:
        cluster, ro = self.recipe.cluster, self.recipe.rollout
        if cluster.train.gpus_per_node:
            bundle = {"GPU": 1, TRAIN_RESOURCE: 1}
            self.train_groups = self._groups("train", cluster.train.nodes, [bundle] * cluster.train.gpus_per_node)
        if ro.gpus_per_engine and not engines_share_train_gpus(self.recipe):
            group = getattr(cluster, rollout_group_name(self.recipe))
            bundle = {"GPU": ro.gpus_per_engine, ROLLOUT_RESOURCE: ro.gpus_per_engine}
            per_node = group.gpus_per_node // ro.gpus_per_engine
            self.engine_groups = self._groups(rollout_group_name(self.recipe), group.nodes, [bundle] * per_node)
        if engines_share_train_gpus(self.recipe):
            self.colocated_gpus = [self._probe(pg, cluster.train.gpus_per_node) for pg in self.train_groups]

    def _groups(self, name: str, nodes: int, bundles: list[dict]) -> list:
        from ray.util.placement_group import placement_group

        groups = [placement_group(bundles, strategy="STRICT_PACK", name=f"relax-{name}-{i}") for i in range(nodes)]
        ready, _ = self._ray.wait([pg.ready() for pg in groups], num_returns=len(groups), timeout=PLACE_TIMEOUT_S)
        if len(ready) < len(groups):
            raise RuntimeError(
                f"cluster.{name}: {len(groups) - len(ready)} of its {nodes} node(s) could not hold "
                f"{len(bundles)} x {bundles[0]} within {PLACE_TIMEOUT_S:.0f} s; Ray has "
                f"{self._ray.available_resources()} free")
        return groups

    def _probe(self, pg, bundles: int) -> list[str]:
        """The GPU id Ray bound to each bundle of `pg` (read by a task in it)."""
        probe = self._ray.remote(num_cpus=0, num_gpus=0.01)(_gpu_id)
        return self._ray.get([probe.options(scheduling_strategy=_in(pg, i)).remote() for i in range(bundles)])

    # ------------------------------------------------------------- options
    def trainer_options(self, rank: int) -> dict[str, Any]:
        """Ray options of trainer rank `rank`: its bundle (its GPU, shared in colocate), or a CPU slot."""
        if not self.train_groups:
            return {"num_cpus": 0, "num_gpus": 0, "resources": {TRAIN_RESOURCE: 1}}
        node, gpu = trainer_gpu(self.recipe, rank)
        share = SHARE if engines_share_train_gpus(self.recipe) else 1
        return {"num_cpus": 0, "num_gpus": share, "resources": {TRAIN_RESOURCE: 1},
                "scheduling_strategy": _in(self.train_groups[node], gpu)}

    @property
    def engine_capacity(self) -> int | None:
        """Policy engines the GPUs hold at once, the judge's slots aside (None: CPU engines, as many as the
        group's slots)."""
        return policy_engine_slots(self.recipe) or None

    def engine_options(self, slot: int) -> tuple[dict[str, Any], list[str] | None]:
        """Ray options of the engine in `slot`, and (colocate on GPUs) the GPU ids its server runs on
        (None: those Ray gives the actor)."""
        tp = self.recipe.rollout.gpus_per_engine
        if not tp:
            return {"num_cpus": 0, "num_gpus": 0, "resources": {ROLLOUT_RESOURCE: 1}}, None
        node, gpus = engine_slot_gpus(self.recipe, slot)
        if self.colocated_gpus:
            return ({"num_cpus": 0, "num_gpus": SHARE, "scheduling_strategy": _in(self.train_groups[node], gpus[0])},
                    [self.colocated_gpus[node][g] for g in gpus])
        bundle = slot % engines_per_node(self.recipe)
        return {"num_cpus": 0, "num_gpus": tp, "resources": {ROLLOUT_RESOURCE: tp},
                "scheduling_strategy": _in(self.engine_groups[node], bundle)}, None

    def release(self) -> None:
        """Remove the placement groups (after the actors in them have ended)."""
        from ray.util.placement_group import remove_placement_group

        for pg in self.train_groups + self.engine_groups:
            remove_placement_group(pg)
        self.train_groups, self.engine_groups = [], []


def _in(pg, bundle: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle,
                                            placement_group_capture_child_tasks=False)


def _gpu_id() -> str:
    import ray

    return str(ray.get_gpu_ids()[0])
