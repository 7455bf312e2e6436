"""Which services a recipe runs, started with the job's other processes and stopped with them.

    fully_async: rollout service, reference workers (when the algorithm uses a reference model and the
                 recipe gives them a node group, `cluster.reference`: one per GPU of it, or one per node
                 of a CPU group), advantage service (when its estimator is outcome-only); the trainer
                 reads their columns
    hybrid:      rollout service only
    colocate:    none
    every mode:  the trainer ranks compute what depends on the weights a step starts from (logp_old,
                 PPO's critic values), and the reference log-probs where no reference group is given

Actors are created at once (their constructors, which load models, run while
the engines and trainer ranks load theirs); TransferQueue is attached on
first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relax_core.config.modes import advantage_service, reference_service, reference_workers
from relax_core.services.fields import ADVANTAGE_COLUMN, REFERENCE_COLUMN
from relax_core.services.rollout import Downstream


def advantage_stage(recipe):
    """What the advantage service computes for `recipe`, as a function of a step's samples; None where the
    trainer computes the advantages (not fully_async, or an estimator that needs more than the rewards)."""
    if not advantage_service(recipe):
        return None
    from relax_core.services.fields import outcome_advantages

    algo = recipe.algorithm
    advantages = outcome_advantages(algo.spec.advantage_estimator, algo.estimator_kwargs())
    return lambda samples: advantages([s.reward for s in samples], [s.group_id for s in samples])


@dataclass
class ServiceSet:
    rollout: Any
    downstream: list[Downstream] = field(default_factory=list)
    fields: tuple[str, ...] = ()  # the columns the services add, which the trainer ranks read

    @classmethod
    def start(cls, ray, recipe, *, model_dir: str, api_key: str, trainer0, engine0, cpu_sets: dict) -> ServiceSet:
        from relax_core.cluster.placement import REFERENCE_RESOURCE
        from relax_core.models.model_dir import trust_remote_code
        from relax_core.services.fields import AdvantageWorker, ReferenceWorker
        from relax_core.services.placement import beside, on_group
        from relax_core.services.rollout import RolloutService

        near_engines = beside(ray, engine0)
        rollout = ray.remote(max_concurrency=4)(RolloutService).options(**near_engines).remote(
            recipe, model_dir, api_key, trainer0, cpu_sets.get("rollout"))
        services = cls(rollout)
        if reference_service(recipe):
            check_capacity(ray, REFERENCE_RESOURCE, reference_workers(recipe), recipe.cluster.reference.gpus_per_node,
                           "cluster.reference")
            own, cpus = recipe.cluster.reference, cpu_sets.get("reference")
            threads = own.cpus_per_node // (own.gpus_per_node or 1) if cpus is None else len(cpus)
            placed = on_group(REFERENCE_RESOURCE, gpus=1 if own.gpus_per_node else 0)
            device = "cuda" if own.gpus_per_node else "cpu"
            worker = ray.remote(ReferenceWorker)
            for _ in range(reference_workers(recipe)):
                handle = worker.options(**placed).remote(model_dir, recipe.model.dtype, recipe.train.micro_batch_size,
                                                         threads, cpus, trust_remote_code(recipe), device)
                services.downstream.append(Downstream("reference", handle, batch_rows=recipe.train.micro_batch_size))
            services.fields += (REFERENCE_COLUMN,)
        if advantage_service(recipe):
            algo = recipe.algorithm
            handle = ray.remote(AdvantageWorker).options(**near_engines).remote(
                algo.spec.advantage_estimator, algo.estimator_kwargs(), cpu_sets.get("rollout"))
            services.downstream.append(Downstream("advantages", handle, whole_step=True))
            services.fields += (ADVANTAGE_COLUMN,)
        return services

    def ready(self, ray) -> str:
        """Block until every service actor is constructed (models loaded); raises a constructor's error.
        Returns where each runs, by node name ("rollout on n2, reference on n3, ...")."""
        actors = self.actors()
        nodes = ray.get([handle.node_id.remote() for _, handle in actors])
        return ", ".join(f"{name} on {node_name(ray, node)}" for (name, _), node in zip(actors, nodes))

    def actors(self) -> list[tuple[str, Any]]:
        """Each service's name and actor handle."""
        return [("rollout", self.rollout), *((d.name, d.handle) for d in self.downstream)]

    def stop(self, ray) -> None:
        """Stop every service: its thread and clients first, then its process."""
        from relax_core.cluster.actors import end_actors

        end_actors(ray, [self.rollout, *(d.handle for d in self.downstream)], "services", method="close", timeout_s=60)


def check_capacity(ray, resource: str, workers: int, gpus_per_node: int, group: str) -> None:
    """Refuse at once a service whose workers the Ray cluster has no room for (a node group that did not join,
    or too few GPUs): placed with Ray, they would wait for a slot forever, and the run with them."""
    have = ray.cluster_resources()
    slots, gpus = int(have.get(resource, 0)), int(have.get("GPU", 0))
    if slots < workers or (gpus_per_node and gpus < workers):
        raise RuntimeError(f"{group}: {workers} worker(s) need {workers} '{resource}' slot(s)"
                           f"{f' and {workers} GPU(s)' if gpus_per_node else ''}, but the Ray cluster has {slots} "
                           f"slot(s) and {gpus} GPU(s): its nodes did not join, or have fewer GPUs than the "
                           "recipe says")


def node_name(ray, node_id: str) -> str:
    """A Ray node's Slurm name (its `relax_node_<name>` resource), or its address on one machine."""
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            names = [key.removeprefix("relax_node_") for key in node["Resources"] if key.startswith("relax_node_")]
            return names[0] if names else node["NodeManagerAddress"]
    return node_id[:8]
