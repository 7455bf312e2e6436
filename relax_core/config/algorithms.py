"""The recipe's `algorithm:` section: each algorithm's parameters, typed, bounded and documented.

Which algorithms exist and what they are made of is declared once, in their
specs (relax_core/config/algorithm_specs.py). Each spec names the class here that
holds its parameters (`AlgorithmSpec.config`) and `config_class` binds that
class to the spec's name; an algorithm without parameters of its own uses
`AlgorithmCommon` (aggregation, KL, off-policy correction) or `ClipConfig`
(plus the PPO clip range). The recipe's `algorithm` field (`AlgorithmConfig`)
picks the class by `name` (default `grpo`) when the recipe is validated, so
an algorithm registered at run time (a plug-in, a test) is accepted like a
built-in one. The classes read their spec to check requirements (PPO without
a critic, OPD without a teacher) and hand the trainer its keyword arguments
(`estimator_kwargs`, `loss_kwargs`, `selection_kwargs`). pydantic only:
nothing heavy is imported.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    PlainValidator,
    SerializeAsAny,
    ValidationError,
    create_model,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from relax_core.config import algorithm_specs as specs
from relax_core.config.algorithm_specs import AlgorithmSpec
from relax_core.config.section import Dtype, Section

DEFAULT_ALGORITHM = "grpo"
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class KLConfig(Section):
    """KL divergence to the frozen reference model."""

    coef: float = Field(0.0, ge=0.0)
    """KL coefficient (beta); 0 turns the KL off (and, unless the algorithm needs it, the reference model)."""
    estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    """KL estimator: k1 (log-ratio), k2 (squared), k3 (low-variance; also called low_var_kl)."""
    placement: Literal["loss", "reward"] = "loss"
    """`loss`: add `coef * agg(k)` to the policy loss; `reward`: subtract `coef * k_t` from the token rewards."""


class CriticConfig(Section):
    """The value model PPO trains next to the policy (the policy's architecture with a value head)."""

    lr: float = Field(1e-5, gt=0.0)
    """Critic learning rate."""
    value_clip: float = Field(0.2, gt=0.0)
    """Clip range eps_v of the value loss."""
    warmup_steps: int = Field(0, ge=0)
    """Steps during which only the critic is trained."""
    init_from: str | None = None
    """Model to initialise the critic's body from; the policy's initial weights if unset."""


class TeacherConfig(Section):
    """The teacher model on-policy distillation scores the student's tokens with."""

    path: str = Field(min_length=1)
    """Hub id or local directory of the teacher (same tokenizer as the student)."""
    dtype: Dtype = "bfloat16"
    """Teacher parameter dtype."""


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling: drop groups whose rewards are all equal, generate more until the batch is full."""

    enabled: bool = True
    """Drop zero-variance groups and refill the batch."""
    max_num_gen_batches: int = Field(10, ge=1)
    """At most this many generation rounds per step; the step then trains on what it has."""


class OverlongConfig(Section):
    """DAPO's soft overlong penalty; the budget L_max is `rollout.max_new_tokens`."""

    enabled: bool = True
    """Add the overlong penalty to the reward."""
    buffer_len: int | None = Field(None, ge=1)
    """Window L_cache before L_max over which the penalty ramps from 0 to -1; a quarter of L_max (rounded
    down) if unset, so a budget under 4 tokens has no window and nothing is penalised."""
    penalty_factor: float = Field(1.0, ge=0.0)
    """Scale of the penalty (1 = the paper's)."""

    def cache_len(self, max_new_tokens: int) -> int:
        """L_cache for a budget L_max = `max_new_tokens`."""
        return self.buffer_len if self.buffer_len is not None else max_new_tokens // 4


DEFAULT_ASYNC_TIS_CAP = 2.0  # docs/algorithms.md, "Off-policy correction"


def _spec_loss_agg(data: dict[str, Any]) -> str:
    """Default of `loss_agg`: the one the algorithm's spec declares (an unknown name is reported on `name`)."""
    name = data.get("name")
    return specs.get_spec(name).loss_agg if name in specs.algorithm_names() else "token-mean"


class AlgorithmCommon(Section):
    """What every algorithm has: aggregation, KL, off-policy correction."""

    name: str
    """Algorithm name (`relax list algorithms` shows them)."""
    loss_agg: LossAgg = Field(default_factory=_spec_loss_agg)
    """How per-token losses are reduced to the step loss; the algorithm's own if unset (`relax list algorithms`)."""
    norm_len: int | None = Field(None, ge=1)
    """Constant length normaliser of `seq-mean-token-sum-norm`; `rollout.max_new_tokens` if unset."""
    kl: KLConfig = Field(default_factory=KLConfig)
    """KL to the reference model."""
    tis_cap: float | None = Field(None, ge=0.0)
    """Truncated importance sampling cap C on the rollout/trainer log-prob mismatch. Null: the mode's
    default (C = 2 in `fully_async` and `hybrid`, where samples may be older than the weights; off in
    `colocate`); 0 turns it off."""

    def effective_tis_cap(self, mode: str) -> float | None:
        """The cap the trainer uses in `mode` (None: no correction)."""
        if self.tis_cap is None:
            from relax_core.config.modes import mode_spec

            return DEFAULT_ASYNC_TIS_CAP if mode_spec(mode).stale_samples else None
        return self.tis_cap or None

    @property
    def spec(self) -> AlgorithmSpec:
        return specs.get_spec(self.name)

    @classmethod
    def tagged_models(cls) -> dict[str, type[AlgorithmCommon]]:
        """Each algorithm's class by name: what the recipe's `algorithm` field accepts (the loader maps
        an error's location through it, to name the valid keys of that algorithm's section)."""
        return {name: config_class(specs.get_spec(name)) for name in specs.algorithm_names()}

    @property
    def uses_reference(self) -> bool:
        """Whether the reference model must be built."""
        return self.spec.needs_reference or self.kl.coef > 0

    @property
    def kl_loss_coef(self) -> float:
        """Coefficient of the KL loss term (0 when the KL goes into the reward)."""
        return self.kl.coef if self.kl.placement == "loss" else 0.0

    def estimator_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the spec's advantage estimator."""
        return {}

    def loss_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the spec's policy loss."""
        return {}

    def selection_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the spec's token selection."""
        return {}

    def recipe_problems(self, *, mode: str, group_size: int, max_new_tokens: int) -> list[str]:
        """Checks against the rest of the recipe (mode, samples per prompt); empty if it fits."""
        return specs.spec_problems(self.name, mode=mode, group_size=group_size)

    @model_validator(mode="after")
    def _needs(self) -> AlgorithmCommon:
        spec, name = self.spec, self.name
        if spec.needs_critic and getattr(self, "critic", None) is None:
            raise ValueError(f"algorithm.critic is missing: algorithm {name} needs a critic (value model), "
                             "e.g. `critic: {lr: 1e-5}`")
        if spec.needs_teacher and getattr(self, "teacher", None) is None:
            raise ValueError(f"algorithm.teacher is missing: algorithm {name} needs a teacher "
                             "(set algorithm.teacher.path)")
        if self.kl.placement == "reward" and "kl_coef" not in self.estimator_kwargs():
            raise ValueError(f"kl.placement: algorithm {name} takes the KL as a loss term only (placement: loss)")
        return self


class ClipMixin(Section):
    """The PPO clipped surrogate's parameters."""

    eps_low: float = Field(0.2, gt=0.0, lt=1.0)
    """Lower clip range of the importance ratio."""
    eps_high: float = Field(0.2, gt=0.0)
    """Upper clip range of the importance ratio (clip-higher when above eps_low)."""
    dual_clip_c: float | None = Field(3.0, gt=1.0)
    """Dual-clip bound c for negative advantages; null disables it."""

    def loss_kwargs(self) -> dict[str, Any]:
        return {"eps_low": self.eps_low, "eps_high": self.eps_high, "dual_clip_c": self.dual_clip_c}


class ClipConfig(ClipMixin, AlgorithmCommon):
    """The common parameters and the PPO clip range: an algorithm with the ppo_clip loss and nothing of its own."""


class PPOConfig(ClipConfig):
    """PPO: GAE advantages from a learned critic, clipped policy loss, clipped value loss."""

    name: Literal["ppo"] = "ppo"
    """Algorithm name."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount factor."""
    lam: float = Field(0.95, ge=0.0, le=1.0)
    """GAE lambda."""
    critic: CriticConfig | None = None
    """The critic (value model); required."""

    def estimator_kwargs(self) -> dict[str, Any]:
        kl = self.kl.coef if self.kl.placement == "reward" else 0.0
        return {"gamma": self.gamma, "lam": self.lam, "kl_coef": kl}


class GRPOConfig(ClipConfig):
    """GRPO: group-normalised outcome advantages with the PPO clipped loss, no critic."""

    name: Literal["grpo"] = "grpo"
    """Algorithm name."""


class DAPOConfig(ClipConfig):
    """DAPO: GRPO with clip-higher, dynamic sampling, token-mean and overlong shaping."""

    name: Literal["dapo"] = "dapo"
    """Algorithm name."""
    eps_high: float = Field(0.28, gt=0.0)
    """Upper clip range of the importance ratio (clip-higher)."""
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    """Dynamic sampling."""
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    """Overlong reward shaping."""

    def recipe_problems(self, *, mode: str, group_size: int, max_new_tokens: int) -> list[str]:
        """Also: the overlong window must fit in the response budget."""
        problems = super().recipe_problems(mode=mode, group_size=group_size, max_new_tokens=max_new_tokens)
        if self.overlong.enabled and self.overlong.cache_len(max_new_tokens) > max_new_tokens:
            problems.append(
                f"algorithm.overlong.buffer_len: {self.overlong.buffer_len} exceeds rollout.max_new_tokens "
                f"({max_new_tokens})"
            )
        return problems


class ReinforcePPConfig(ClipConfig):
    """REINFORCE++: KL-penalised token rewards, discounted return, batch-whitened advantages."""

    name: Literal["reinforce_pp"] = "reinforce_pp"
    """Algorithm name."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount factor of the token-reward return."""
    kl: KLConfig = Field(default_factory=lambda: KLConfig(coef=0.001, placement="reward"))
    """KL to the reference model, in the token rewards (placement `reward`, coef > 0)."""

    def estimator_kwargs(self) -> dict[str, Any]:
        kl = self.kl.coef if self.kl.placement == "reward" else 0.0
        return {"gamma": self.gamma, "kl_coef": kl}

    @model_validator(mode="after")
    def _kl_in_reward(self) -> ReinforcePPConfig:
        if self.kl.placement != "reward" or self.kl.coef <= 0:
            raise ValueError("kl: reinforce_pp puts the KL into the rewards; set kl.placement: reward and kl.coef > 0")
        return self


class GSPOConfig(ClipConfig):
    """GSPO: sequence-level importance ratio, clipped per sequence with small eps."""

    name: Literal["gspo"] = "gspo"
    """Algorithm name."""
    eps_low: float = Field(3e-4, gt=0.0, lt=1.0)
    """Lower clip range of the sequence ratio (paper: 3e-4)."""
    eps_high: float = Field(4e-4, gt=0.0)
    """Upper clip range of the sequence ratio (paper: 4e-4)."""
    dual_clip_c: float | None = Field(None, gt=1.0)
    """Dual-clip bound for negative advantages; off by default for GSPO."""


class SAPOConfig(AlgorithmCommon):
    """SAPO: a soft sigmoid gate on the ratio instead of a hard clip."""

    name: Literal["sapo"] = "sapo"
    """Algorithm name."""
    tau_pos: float = Field(1.0, gt=0.0)
    """Gate temperature for tokens with positive advantage."""
    tau_neg: float = Field(1.05, gt=0.0)
    """Gate temperature for tokens with negative advantage."""

    def loss_kwargs(self) -> dict[str, Any]:
        return {"tau_pos": self.tau_pos, "tau_neg": self.tau_neg}


class CISPOConfig(AlgorithmCommon):
    """CISPO: clipped, gradient-free importance weight times REINFORCE on every token."""

    name: Literal["cispo"] = "cispo"
    """Algorithm name."""
    eps_low: float = Field(1.0, gt=0.0, le=1.0)
    """Lower clip range of the weight; 1.0 = no lower bound (MiniMax-M1)."""
    eps_high: float = Field(0.28, gt=0.0)
    """Upper clip range of the weight."""

    def loss_kwargs(self) -> dict[str, Any]:
        return {"eps_low": self.eps_low, "eps_high": self.eps_high}


class M2POConfig(ClipConfig):
    """M2PO: mask the tokens with the largest rollout/trainer log-ratio^2 until its mean is under a threshold."""

    name: Literal["m2po"] = "m2po"
    """Algorithm name."""
    m2_threshold: float = Field(0.04, gt=0.0)
    """Bound on the mean squared log-ratio of the kept tokens (paper: 0.04)."""

    def selection_kwargs(self) -> dict[str, Any]:
        return {"m2_threshold": self.m2_threshold}


class OPDConfig(ClipConfig):
    """On-policy distillation: per-token reverse KL to a teacher as the advantage, PPO clipped loss."""

    name: Literal["opd"] = "opd"
    """Algorithm name."""
    teacher: TeacherConfig | None = None
    """The teacher model; required."""


@functools.cache
def config_class(spec: AlgorithmSpec) -> type[AlgorithmCommon]:
    """The class that validates `spec`'s recipe section: `spec.config`, its `name` bound to `spec.name`.

    A class written for one algorithm (its `name` defaults to that algorithm's) is used as is; a shared
    one (AlgorithmCommon, ClipConfig, or another algorithm's class) gets a subclass with the name.
    """
    base = spec.config or AlgorithmCommon
    if not issubclass(base, AlgorithmCommon):
        raise TypeError(f"algorithm {spec.name}: config must subclass AlgorithmCommon, got {base}")
    if base.model_fields["name"].default == spec.name:
        return base
    title = "".join(part.capitalize() for part in spec.name.replace("-", "_").split("_"))
    return create_model(
        f"{title}Config", __base__=base, __doc__=spec.description, __module__=__name__,
        name=(Literal[spec.name], Field(spec.name, description="Algorithm name.")),  # type: ignore[valid-type]
    )


def _validate_algorithm(value: Any) -> AlgorithmCommon:
    """The recipe's `algorithm` section validated by the class of the algorithm it names."""
    name = value.get("name", DEFAULT_ALGORITHM) if isinstance(value, dict) else getattr(value, "name", None)
    if name not in specs.algorithm_names():
        message = f"unknown algorithm {name!r}; valid names: {', '.join(specs.algorithm_names())}"
        raise ValidationError.from_exception_data("algorithm", [InitErrorDetails(
            type=PydanticCustomError("value_error", message), loc=("name",), input=name)])
    model = config_class(specs.get_spec(name))
    if isinstance(value, model):
        return value
    try:
        return model.model_validate(value)
    except ValidationError as exc:  # located under the name, as pydantic locates a tagged union's errors
        errors = [{**e, "loc": (name, *e["loc"])} for e in exc.errors(include_url=False)]
        raise ValidationError.from_exception_data(exc.title, errors) from None  # type: ignore[arg-type]


AlgorithmConfig = Annotated[SerializeAsAny[AlgorithmCommon], PlainValidator(_validate_algorithm)]


def algorithm_problems(algo: AlgorithmCommon, *, mode: str, group_size: int, max_new_tokens: int) -> list[str]:
    """Checks against the rest of the recipe (each algorithm's `recipe_problems`)."""
    return algo.recipe_problems(mode=mode, group_size=group_size, max_new_tokens=max_new_tokens)


# The built-in algorithms (a plug-in registers its own the same way).
for _spec in (
    AlgorithmSpec(
        "ppo", "gae", "ppo_clip", "token-mean",
        "PPO: GAE advantages from a learned critic, clipped surrogate and clipped value loss",
        config=PPOConfig, needs_critic=True, min_group_size=1,
    ),
    AlgorithmSpec("grpo", "grpo", "ppo_clip", "token-mean",
                  "GRPO: group-normalised outcome advantages, clipped surrogate, no critic",
                  config=GRPOConfig, outcome_only=True),
    AlgorithmSpec("dr_grpo", "dr_grpo", "ppo_clip", "seq-mean-token-sum-norm",
                  "Dr. GRPO: group-centred advantages without std, constant length normaliser",
                  config=ClipConfig, outcome_only=True),
    AlgorithmSpec("dapo", "grpo", "ppo_clip", "token-mean",
                  "DAPO: GRPO with clip-higher, dynamic sampling, token-mean and overlong shaping",
                  config=DAPOConfig, outcome_only=True),
    AlgorithmSpec("rloo", "rloo", "ppo_clip", "token-mean",
                  "RLOO: leave-one-out baseline advantages, clipped surrogate",
                  config=ClipConfig, outcome_only=True),
    AlgorithmSpec("reinforce_pp", "reinforce_pp", "ppo_clip", "token-mean",
                  "REINFORCE++: KL-penalised token rewards, discounted return, batch-whitened",
                  config=ReinforcePPConfig, needs_reference=True, min_group_size=1),
    AlgorithmSpec("reinforce_pp_baseline", "reinforce_pp_baseline", "ppo_clip", "token-mean",
                  "REINFORCE++ with group-mean baseline, batch-whitened",
                  config=ClipConfig),
    # seq-mean-token-mean makes GSPO's gradient the sequence-level objective's
    AlgorithmSpec("gspo", "grpo", "gspo", "seq-mean-token-mean",
                  "GSPO: sequence-level importance ratio with tight clipping",
                  config=GSPOConfig, outcome_only=True),
    AlgorithmSpec("sapo", "grpo", "sapo", "seq-mean-token-mean",
                  "SAPO: soft sigmoid gate on the importance ratio instead of a hard clip",
                  config=SAPOConfig, outcome_only=True),
    AlgorithmSpec("cispo", "grpo", "cispo", "token-mean",
                  "CISPO: clipped, gradient-free importance weight times REINFORCE on every token",
                  config=CISPOConfig, outcome_only=True),
    AlgorithmSpec("m2po", "grpo", "ppo_clip", "token-mean",
                  "M2PO: drop tokens with the largest rollout/trainer log-ratio^2 until its mean <= threshold",
                  config=M2POConfig, token_selection="m2"),
    AlgorithmSpec("opd", "opd", "ppo_clip", "token-mean",
                  "On-policy distillation: per-token reverse KL to a teacher as the advantage",
                  config=OPDConfig, needs_teacher=True, needs_logp_old=True, min_group_size=1),
):
    specs.register_algorithm(_spec)
