"""What each RL algorithm is made of: one declared `AlgorithmSpec` per `algorithm.name`.

The recipe names an algorithm; the controller and trainer look its spec up
here to know which advantage estimator (registry kind "estimator"), policy
loss (kind "loss") and default loss aggregation (kind "loss_agg") to resolve,
which models to build (critic, reference, teacher), and which recipes to
reject (group size, mode). Adding an algorithm is one entry here, its
functions in the registry, and its config class in
relax_core/config/algorithms.py. Pure data: no torch, so `relax list
algorithms` and recipe validation stay light.
"""

from __future__ import annotations

from dataclasses import dataclass

ALL_MODES = ("colocate", "fully_async", "hybrid")


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm's building blocks and requirements.

    Attributes:
        name: the recipe's `algorithm.name`.
        advantage_estimator: name under registry kind "estimator".
        policy_loss: name under registry kind "loss".
        loss_agg: default loss aggregation (the config may override it).
        needs_critic: trains a value model next to the policy (PPO).
        needs_reference: always needs the frozen reference model (KL in the
            reward); any algorithm needs it when its KL coefficient is > 0.
        needs_teacher: needs a teacher model's log-probs (distillation).
        needs_rollout_logp: the loss reads the engine's log-probs (`logp_rollout`).
        min_group_size: smallest `rollout.n_samples_per_prompt` it makes sense with.
        modes: recipe `mode`s it supports.
        description: one line for `relax list algorithms`.
    """

    name: str
    advantage_estimator: str
    policy_loss: str
    loss_agg: str
    description: str
    needs_critic: bool = False
    needs_reference: bool = False
    needs_teacher: bool = False
    needs_rollout_logp: bool = False
    min_group_size: int = 2
    modes: tuple[str, ...] = ALL_MODES


def _specs(*specs: AlgorithmSpec) -> dict[str, AlgorithmSpec]:
    return {s.name: s for s in specs}


ALGORITHM_SPECS: dict[str, AlgorithmSpec] = _specs(
    AlgorithmSpec(
        "ppo", "gae", "ppo_clip", "token-mean",
        "PPO: GAE advantages from a learned critic, clipped surrogate and clipped value loss",
        needs_critic=True, min_group_size=1,
        # the critic is updated in lock-step with the actor on the same nodes
        modes=("colocate", "hybrid"),
    ),
    AlgorithmSpec("grpo", "grpo", "ppo_clip", "token-mean",
                  "GRPO: group-normalised outcome advantages, clipped surrogate, no critic"),
    AlgorithmSpec("dr_grpo", "dr_grpo", "ppo_clip", "seq-mean-token-sum-norm",
                  "Dr. GRPO: group-centred advantages without std, constant length normaliser"),
    AlgorithmSpec("dapo", "grpo", "ppo_clip", "token-mean",
                  "DAPO: GRPO with clip-higher, dynamic sampling, token-mean and overlong shaping"),
    AlgorithmSpec("rloo", "rloo", "ppo_clip", "token-mean",
                  "RLOO: leave-one-out baseline advantages, clipped surrogate"),
    AlgorithmSpec("reinforce_pp", "reinforce_pp", "ppo_clip", "token-mean",
                  "REINFORCE++: KL-penalised token rewards, discounted return, batch-whitened",
                  needs_reference=True, min_group_size=1),
    AlgorithmSpec("reinforce_pp_baseline", "reinforce_pp_baseline", "ppo_clip", "token-mean",
                  "REINFORCE++ with group-mean baseline, batch-whitened"),
    AlgorithmSpec("gspo", "grpo", "gspo", "seq-mean-token-mean",
                  "GSPO: sequence-level importance ratio with tight clipping"),
    AlgorithmSpec("sapo", "grpo", "sapo", "seq-mean-token-mean",
                  "SAPO: soft sigmoid gate on the importance ratio instead of a hard clip"),
    AlgorithmSpec("cispo", "grpo", "cispo", "token-mean",
                  "CISPO: clipped, gradient-free importance weight times REINFORCE on every token"),
    AlgorithmSpec("m2po", "grpo", "m2po", "token-mean",
                  "M2PO: drop tokens with the largest rollout/trainer log-ratio^2 until its mean <= threshold",
                  needs_rollout_logp=True),
    AlgorithmSpec("opd", "opd", "ppo_clip", "token-mean",
                  "On-policy distillation: per-token reverse KL to a teacher as the advantage",
                  needs_teacher=True, min_group_size=1),
)


def get_spec(name: str) -> AlgorithmSpec:
    """The spec of `name`; a KeyError naming the valid algorithms otherwise."""
    if name not in ALGORITHM_SPECS:
        raise KeyError(f"unknown algorithm '{name}'; valid names: {', '.join(sorted(ALGORITHM_SPECS))}")
    return ALGORITHM_SPECS[name]


def spec_problems(name: str, *, mode: str, group_size: int) -> list[str]:
    """Why a recipe's mode and `n_samples_per_prompt` do not suit the algorithm (empty if they do)."""
    spec, problems = get_spec(name), []
    if mode not in spec.modes:
        problems.append(f"mode: algorithm {name} supports modes {', '.join(spec.modes)}, not {mode}")
    if group_size < spec.min_group_size:
        problems.append(
            f"rollout.n_samples_per_prompt: algorithm {name} needs groups of at least "
            f"{spec.min_group_size} samples per prompt, got {group_size}"
        )
    return problems
