"""What each RL algorithm is made of: one declared `AlgorithmSpec` per `algorithm.name`, the one source.

The recipe names an algorithm; everything else reads its spec instead of
keeping its own list: the recipe schema (the class that validates the
`algorithm:` section, the modes and group sizes it accepts), the trainer
(which estimator, loss, token selection and aggregation to resolve in
algorithms/registry.py, which log-probs to compute before the update, which
models to build), the `fully_async` advantage stage (whether the rollout side
can compute the advantages) and `relax list algorithms`. It sits in config,
beside the specs of the modes and engine kinds, because the schema reads it;
the implementations it names sit a layer up, in `relax_core.algorithms`.

Adding an algorithm takes its function(s), registered with a decorator where
they are defined (algorithms/registry.py), and one `register_algorithm(AlgorithmSpec(...))`
(plus a config class in config/algorithms.py if it has parameters of its own). The names
in a spec are resolved only when the trainer starts, so this module imports no torch:
recipe validation and `relax list algorithms` stay light.
"""

from __future__ import annotations

from dataclasses import dataclass

from relax_core.config import algorithms as cfg
from relax_core.config.modes import MODE_NAMES

ALL_MODES = MODE_NAMES


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm's building blocks and requirements.

    Attributes:
        name: the recipe's `algorithm.name`.
        advantage_estimator: name of a `@register_estimator` function.
        policy_loss: name of a `@register_loss` function.
        loss_agg: default loss aggregation (`@register_loss_agg`); the recipe may override it.
        description: one line for `relax list algorithms`.
        config: the class of its recipe section's parameters (config/algorithms.py;
            bound to `name` by `config_class`): the common ones only by default.
        token_selection: name of a `@register_token_selection` function run once over
            the whole step before the update (M2PO); the loss is aggregated over the
            tokens it keeps. It reads `logp_old` and the engine's log-probs.
        needs_logp_old: the estimator reads `logp_old` (`AdvantageBatch.logp`), so the
            trainer computes it before the step's first update (on-policy distillation).
        outcome_only: the advantages depend on the rewards and group ids alone and
            nothing else runs before the loss, so `fully_async` computes them on the
            rollout side (one value per sample).
        needs_critic: trains a value model next to the policy (PPO).
        needs_reference: always needs the frozen reference model (KL in the
            reward); any algorithm needs it when its KL coefficient is > 0.
        needs_teacher: needs a teacher model's log-probs (distillation).
        min_group_size: smallest `rollout.n_samples_per_prompt` it makes sense with.
        modes: recipe `mode`s it supports.
    """

    name: str
    advantage_estimator: str
    policy_loss: str
    loss_agg: str
    description: str
    config: type[cfg.AlgorithmCommon] = cfg.AlgorithmCommon
    token_selection: str | None = None
    needs_logp_old: bool = False
    outcome_only: bool = False
    needs_critic: bool = False
    needs_reference: bool = False
    needs_teacher: bool = False
    min_group_size: int = 2
    modes: tuple[str, ...] = ALL_MODES

    def __post_init__(self) -> None:
        if not issubclass(self.config, cfg.AlgorithmCommon):
            raise TypeError(f"algorithm {self.name}: config must subclass AlgorithmCommon, got {self.config}")
        if self.outcome_only and (self.token_selection or self.needs_logp_old or self.needs_critic):
            raise ValueError(f"algorithm {self.name}: outcome_only excludes a token selection, logp_old and a critic")
        if unknown := set(self.modes) - set(ALL_MODES):
            raise ValueError(f"algorithm {self.name}: unknown modes {sorted(unknown)}; valid: {', '.join(ALL_MODES)}")


_SPECS: dict[str, AlgorithmSpec] = {}


def register_algorithm(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Make `spec.name` an algorithm a recipe can name (built-ins below; a plug-in or a test likewise)."""
    if _SPECS.get(spec.name, spec) != spec:
        raise ValueError(f"algorithm '{spec.name}' is already registered")
    _SPECS[spec.name] = spec
    return spec


def algorithm_names() -> list[str]:
    """Every registered algorithm, sorted."""
    return sorted(_SPECS)


def get_spec(name: str) -> AlgorithmSpec:
    """The spec of `name`; a KeyError naming the valid algorithms otherwise."""
    if name not in _SPECS:
        raise KeyError(f"unknown algorithm '{name}'; valid names: {', '.join(algorithm_names())}")
    return _SPECS[name]


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


for _spec in (
    AlgorithmSpec(
        "ppo", "gae", "ppo_clip", "token-mean",
        "PPO: GAE advantages from a learned critic, clipped surrogate and clipped value loss",
        config=cfg.PPOConfig, needs_critic=True, min_group_size=1,
    ),
    AlgorithmSpec("grpo", "grpo", "ppo_clip", "token-mean",
                  "GRPO: group-normalised outcome advantages, clipped surrogate, no critic",
                  config=cfg.GRPOConfig, outcome_only=True),
    AlgorithmSpec("dr_grpo", "dr_grpo", "ppo_clip", "seq-mean-token-sum-norm",
                  "Dr. GRPO: group-centred advantages without std, constant length normaliser",
                  config=cfg.ClipConfig, outcome_only=True),
    AlgorithmSpec("dapo", "grpo", "ppo_clip", "token-mean",
                  "DAPO: GRPO with clip-higher, dynamic sampling, token-mean and overlong shaping",
                  config=cfg.DAPOConfig, outcome_only=True),
    AlgorithmSpec("rloo", "rloo", "ppo_clip", "token-mean",
                  "RLOO: leave-one-out baseline advantages, clipped surrogate",
                  config=cfg.ClipConfig, outcome_only=True),
    AlgorithmSpec("reinforce_pp", "reinforce_pp", "ppo_clip", "token-mean",
                  "REINFORCE++: KL-penalised token rewards, discounted return, batch-whitened",
                  config=cfg.ReinforcePPConfig, needs_reference=True, min_group_size=1),
    AlgorithmSpec("reinforce_pp_baseline", "reinforce_pp_baseline", "ppo_clip", "token-mean",
                  "REINFORCE++ with group-mean baseline, batch-whitened",
                  config=cfg.ClipConfig),
    # seq-mean-token-mean makes GSPO's gradient the sequence-level objective's
    AlgorithmSpec("gspo", "grpo", "gspo", "seq-mean-token-mean",
                  "GSPO: sequence-level importance ratio with tight clipping",
                  config=cfg.GSPOConfig, outcome_only=True),
    AlgorithmSpec("sapo", "grpo", "sapo", "seq-mean-token-mean",
                  "SAPO: soft sigmoid gate on the importance ratio instead of a hard clip",
                  config=cfg.SAPOConfig, outcome_only=True),
    AlgorithmSpec("cispo", "grpo", "cispo", "token-mean",
                  "CISPO: clipped, gradient-free importance weight times REINFORCE on every token",
                  config=cfg.CISPOConfig, outcome_only=True),
    AlgorithmSpec("m2po", "grpo", "ppo_clip", "token-mean",
                  "M2PO: drop tokens with the largest rollout/trainer log-ratio^2 until its mean <= threshold",
                  config=cfg.M2POConfig, token_selection="m2"),
    AlgorithmSpec("opd", "opd", "ppo_clip", "token-mean",
                  "On-policy distillation: per-token reverse KL to a teacher as the advantage",
                  config=cfg.OPDConfig, needs_teacher=True, needs_logp_old=True, min_group_size=1),
):
    register_algorithm(_spec)
