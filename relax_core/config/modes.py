"""The three modes, and what each runs where: every difference between modes is read from this table.

    colocate     the driver generates a step, scores it, trains on it, then syncs the weights: nothing
                 overlaps, and every sample is from the weights being trained (on GPUs the engines and
                 the trainer take turns on the same GPUs)
    fully_async  a rollout service generates on a node group of its own while the trainer trains, at
                 most `rollout.max_staleness` steps ahead; samples travel through TransferQueue, the
                 engines get the newest weights before each step they generate, and services beside
                 the bus fill fields of a step's rows (reference log-probs on a reference node group,
                 outcome-only advantages)
    hybrid       as fully_async, but the trainer ranks compute the reference log-probs and the
                 advantages themselves, as in colocate

(controller/streaming.py draws the asynchronous modes' step.)

A new mode is one more row; code that must behave differently in some mode asks `mode_spec(name)` for the
property it depends on, by its name, and never compares the mode's name itself.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModeSpec:
    name: str
    loop: str
    """The training loop, "module:function" (relax_core/controller/)."""
    bus: bool
    """Samples travel through TransferQueue: its controller and storage units start with the job, and Ray
    CPUs are set aside for them on the training nodes."""
    rollout_service: bool
    """A rollout service (a Ray actor beside the engines) generates and scores the samples; else the
    driver's own rollout manager does, between training steps."""
    own_rollout_group: bool
    """The engines need a node group of their own (`cluster.rollout`): they generate while the trainer
    trains."""
    stale_samples: bool
    """A sample may come from weights older than those it is trained on: truncated importance sampling
    is on by default (`algorithm.tis_cap`)."""
    field_services: bool
    """Services beside the bus may compute a step's reference log-probs (on `cluster.reference`) and
    outcome-only advantages, ahead of the trainer."""


MODES: dict[str, ModeSpec] = {spec.name: spec for spec in (
    ModeSpec("colocate", loop="relax_core.controller.colocate:train_colocate", bus=False, rollout_service=False,
             own_rollout_group=False, stale_samples=False, field_services=False),
    ModeSpec("fully_async", loop="relax_core.controller.streaming:train_fully_async", bus=True,
             rollout_service=True, own_rollout_group=True, stale_samples=True, field_services=True),
    ModeSpec("hybrid", loop="relax_core.controller.streaming:train_hybrid", bus=True, rollout_service=True,
             own_rollout_group=True, stale_samples=True, field_services=False),
)}
MODE_NAMES = tuple(MODES)
DEFAULT_MODE = "colocate"  # the quick start's, and the simplest: nothing overlaps


def mode_spec(name: str) -> ModeSpec:
    """The spec of mode `name`; a KeyError naming the valid modes otherwise."""
    if name not in MODES:
        raise KeyError(f"unknown mode '{name}'; valid modes: {', '.join(MODE_NAMES)}")
    return MODES[name]


# What a recipe runs beside the bus, by its mode and algorithm (the `recipe` of relax_core/config/schema.py).
def reference_service(recipe) -> bool:
    """The reference log-probs come from the reference workers: fully_async, a reference model, and a node
    group for it (`cluster.reference`); else the trainer ranks compute them."""
    return (mode_spec(recipe.mode).field_services and recipe.algorithm.uses_reference
            and recipe.cluster.reference.nodes > 0)


def reference_workers(recipe) -> int:
    """How many reference workers run: one per GPU of the reference group, or one per node of a CPU group."""
    own = recipe.cluster.reference
    return own.nodes * (own.gpus_per_node or 1) if reference_service(recipe) else 0


def advantage_service(recipe) -> bool:
    """The advantages come from the advantage service (fully_async and an outcome-only estimator)."""
    return mode_spec(recipe.mode).field_services and recipe.algorithm.spec.outcome_only
