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
(plus a config class in config/algorithms.py if it has parameters of its own). The
built-in algorithms' specs are at the end of config/algorithms.py, beside the classes
they name; this module is the registry they go into, and imports none of them. The names
in a spec are resolved only when the trainer starts, so this module imports no torch:
recipe validation and `relax list algorithms` stay light.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        config: the class of its recipe section's parameters, a subclass of config/algorithms.py's
            `AlgorithmCommon` (bound to `name` by `config_class`); None: the common ones only.
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
    config: type | None = None
    token_selection: str | None = None
    needs_logp_old: bool = False
    outcome_only: bool = False
    needs_critic: bool = False
    needs_reference: bool = False
    needs_teacher: bool = False
    min_group_size: int = 2
    modes: tuple[str, ...] = ALL_MODES

    def __post_init__(self) -> None:
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
