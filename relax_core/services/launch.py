"""Which services a recipe runs, started with the job's other processes and stopped with them.

    fully_async: rollout service, reference workers (when the algorithm uses a reference model),
                 actor-forward worker (when the trainer would recompute logp_old before its updates),
                 advantage service (when its estimator is outcome-only), critic worker (PPO: values
                 before each step, its own update after it); the trainer reads their columns
    hybrid:      rollout service only; the trainer ranks compute reference log-probs and advantages
    colocate:    none

Actors are created at once (their constructors, which load models, run while
the engines and trainer ranks load theirs); TransferQueue is attached on
first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relax_core.services.critic import VALUE_COLUMN
from relax_core.services.fields import ADVANTAGE_COLUMN, OLD_LOGP_COLUMN, REFERENCE_COLUMN
from relax_core.services.rollout import Downstream


def reference_service(recipe) -> bool:
    """The reference log-probs come from the reference workers (fully_async and a reference model)."""
    return recipe.mode == "fully_async" and recipe.algorithm.uses_reference


def actor_forward_service(recipe) -> bool:
    """The policy's log-probs before the step's updates (logp_old) come from the actor-forward worker:
    fully_async, and the trainer would otherwise run a forward for them: several updates per step
    (`train.global_batch_size` below the step's samples, `train.ppo_epochs` > 1), or an algorithm that
    reads them before its update (an estimator, a token selection, the KL in the reward)."""
    if recipe.mode != "fully_async":
        return False
    algo, train = recipe.algorithm, recipe.train
    updates = recipe.samples_per_step // (train.global_batch_size or recipe.samples_per_step) * train.ppo_epochs
    kl_in_reward = float(algo.estimator_kwargs().get("kl_coef", 0.0)) > 0
    return updates > 1 or algo.spec.needs_logp_old or bool(algo.spec.token_selection) or kl_in_reward


def advantage_service(recipe) -> bool:
    """The advantages come from the advantage service (fully_async and an outcome-only estimator)."""
    return recipe.mode == "fully_async" and recipe.algorithm.spec.outcome_only


def critic_service(recipe) -> bool:
    """The critic (PPO's value model) is a service of its own: fully_async and an algorithm with a critic."""
    return recipe.mode == "fully_async" and recipe.algorithm.spec.needs_critic


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
    actor_forward: Any = None  # the actor-forward worker, which gets the actor's weights after each step
    critic: Any = None  # the critic worker, which the driver has update after each step

    @classmethod
    def start(cls, ray, recipe, *, model_dir: str, api_key: str, trainer0, engine0, cpu_sets: dict,
              train_threads: int) -> ServiceSet:
        from relax_core.cluster.node import REFERENCE_RESOURCE
        from relax_core.controller import setup
        from relax_core.services.critic import CriticWorker
        from relax_core.services.fields import ActorForwardWorker, AdvantageWorker, ReferenceWorker
        from relax_core.services.placement import beside, on_group
        from relax_core.services.rollout import RolloutService

        near_engines = beside(ray, engine0)
        rollout = ray.remote(max_concurrency=4)(RolloutService).options(**near_engines).remote(
            recipe, model_dir, api_key, trainer0, cpu_sets.get("rollout"))
        services = cls(rollout)
        if reference_service(recipe):
            own = recipe.cluster.reference
            if own.nodes:
                placed, count, cpus = on_group(REFERENCE_RESOURCE), own.nodes, cpu_sets.get("reference")
                threads = own.cpus_per_node if cpus is None else len(cpus)
            else:  # where it fits: beside trainer rank 0, on whichever of the node's cores is idle
                placed, count, cpus, threads = beside(ray, trainer0), 1, idle_cores(cpu_sets), train_threads
            worker = ray.remote(ReferenceWorker)
            for _ in range(count):
                handle = worker.options(**placed).remote(model_dir, recipe.model.dtype, recipe.train.micro_batch_size,
                                                         threads, cpus, setup.trust_remote_code(recipe))
                services.downstream.append(Downstream("reference", handle))
            services.fields += (REFERENCE_COLUMN,)
        if actor_forward_service(recipe):  # where it fits: beside trainer rank 0, whose weights it gets
            worker = ray.remote(max_concurrency=2)(ActorForwardWorker)
            services.actor_forward = worker.options(**beside(ray, trainer0)).remote(
                model_dir, recipe.model.dtype, recipe.train.micro_batch_size, train_threads, idle_cores(cpu_sets),
                setup.trust_remote_code(recipe), 0, _frozen(recipe))
            services.downstream.append(Downstream("actor_forward", services.actor_forward))
            services.fields += (OLD_LOGP_COLUMN,)
        if critic_service(recipe):  # beside trainer rank 0 too: it trains on the same mini-batches
            worker = ray.remote(max_concurrency=4)(CriticWorker)
            services.critic = worker.options(**beside(ray, trainer0)).remote(
                model_dir, setup.trainer_config(recipe), recipe.train_ranks, train_threads, idle_cores(cpu_sets))
            services.downstream.append(Downstream("critic", services.critic))
            services.fields += (VALUE_COLUMN,)
        if advantage_service(recipe):
            algo = recipe.algorithm
            handle = ray.remote(AdvantageWorker).options(**near_engines).remote(
                algo.spec.advantage_estimator, algo.estimator_kwargs(), cpu_sets.get("rollout"))
            services.downstream.append(Downstream("advantages", handle))
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

    def send_weights(self, trainer0, version: int | None = None) -> None:
        """Hand the actor's newest weights to the actor-forward worker (none: nothing to do); trainer rank 0
        gives them to it through the object store, the driver sees only the reference. `version` given:
        the live weights as that version (before the first step, on start or resume)."""
        if self.actor_forward is not None:
            self.actor_forward.set_weights.remote(trainer0.policy_weights.remote(version))

    def update_critic(self, step: int, count: int):
        """Have the critic worker train on step `step` (its `count` rows hold the trainer's returns now); the
        ref of its metrics, or None without a critic service."""
        return None if self.critic is None else self.critic.update.remote(step, count)

    def critic_state(self):
        """The ref of the critic worker's state, for trainer rank 0 to save with a checkpoint (or None)."""
        return None if self.critic is None else self.critic.state_dict.remote()

    def load_critic(self, ray, ckpt_dir: str, step: int) -> None:
        """On resume: the critic worker reads its state from checkpoint `step` (nothing without one)."""
        if self.critic is not None:
            ray.get(self.critic.load_checkpoint.remote(ckpt_dir, step))

    def stop(self, ray) -> None:
        """Stop every service: its thread and clients first, then its process."""
        from relax_core.controller.workers import end_actors

        end_actors(ray, [self.rollout, *(d.handle for d in self.downstream)], "services", method="close", timeout_s=60)


def idle_cores(cpu_sets: dict) -> list[int] | None:
    """The cores a service beside trainer rank 0 may use where every group shares one machine (local
    executor): the train and rollout groups' cores together, so the OS runs it where nothing else does
    (the engines' core once a step is generated, rather than the trainer's). None: no pinning (Slurm)."""
    cores = sorted({*cpu_sets.get("train", ()), *cpu_sets.get("rollout", ())})
    return cores or None


def node_name(ray, node_id: str) -> str:
    """A Ray node's Slurm name (its `relax_node_<name>` resource), or its address on one machine."""
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            names = [key.removeprefix("relax_node_") for key in node["Resources"] if key.startswith("relax_node_")]
            return names[0] if names else node["NodeManagerAddress"]
    return node_id[:8]


def _frozen(recipe) -> tuple[bool, bool]:
    """The trainer's (`freeze_vision`, `freeze_audio`): encoders the actor's weights come without."""
    return (getattr(recipe.train, "freeze_vision", False), getattr(recipe.train, "freeze_audio", False))
