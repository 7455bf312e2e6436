"""Settings of the torch training backend (a plain dataclass, no pydantic).

The lead's recipe schema (relax_core/config) maps a recipe's `train` and
`algorithm` sections onto this; `TorchTrainer` reads nothing else.
Importing this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TorchTrainerConfig:
    """Optimizer, schedule, batching and loss settings of `TorchTrainer`.

    Attributes:
        lr: peak learning rate of AdamW.
        weight_decay: decoupled (AdamW) weight decay.
        betas: AdamW betas.
        adam_eps: AdamW epsilon.
        grad_clip: clip the global gradient norm to this; <= 0 disables clipping
            (the norm is still reported).
        lr_schedule: "constant", "cosine" or "linear" (decay after warmup).
        warmup_steps: linear warmup length, in train steps.
        total_steps: train steps over which cosine/linear decay runs.
        min_lr_ratio: the decayed lr floor, as a fraction of `lr`.
        micro_batch_size: samples per forward/backward (gradient accumulation unit).
        num_mini_batches: optimizer steps per train step (the batch is split
            into this many mini-batches); 1 = fully on-policy.
        num_epochs: passes over the batch per train step (PPO epochs).
        advantage_estimator: name under registry kind "estimator" ("grpo",
            "rloo", "reinforce_pp", "gae", "opd", ...): the spec's estimator.
        estimator_kwargs: its keyword arguments (`AlgorithmConfig.estimator_kwargs()`);
            a `kl_coef` > 0 puts the KL to the reference into the token rewards.
        policy_loss: name under registry kind "loss" ("ppo_clip", "gspo",
            "cispo", "sapo", "m2po").
        loss_kwargs: its keyword arguments (`AlgorithmConfig.loss_kwargs()`);
            None = `eps_low`, `eps_high`, `dual_clip_c` below (the clipped losses).
        eps_low / eps_high: PPO clip range `[1-eps_low, 1+eps_high]` (DAPO clip-higher: 0.2 / 0.28).
        dual_clip_c: dual-clip constant for negative advantages; None disables.
        loss_agg: "token-mean", "seq-mean-token-sum", "seq-mean-token-mean"
            or "seq-mean-token-sum-norm".
        norm_len: constant length for "seq-mean-token-sum-norm"; None = the
            longest response of the step.
        use_kl_loss: add `kl_coef * agg(kl)` against a frozen reference model.
        use_reference: build the reference model even without the KL loss
            (KL in the reward).
        teacher_path: HF model directory of the distillation teacher (opd);
            its log-probs of the response tokens feed the estimator.
        teacher_dtype: the teacher's parameter dtype.
        critic_lr: learning rate of PPO's critic (value model); None = no critic.
        critic_path: HF directory the critic's body starts from; None = the policy's.
        critic_value_clip: eps_v of the clipped value loss.
        critic_warmup_steps: train steps during which only the critic is updated.
        kl_coef: weight of the KL loss term.
        kl_estimator: "k1", "k2", "k3" (= "low_var_kl").
        tis_cap: truncated importance sampling cap C for the rollout/trainer
            mismatch; None disables TIS.
        seed: torch seed set when the trainer is built.
        dtype: parameter dtype, "float32" or "bfloat16" (log-softmax is always float32).
        device: torch device string ("cpu" here; "cuda" on a GPU node).
        num_threads: if set, `torch.set_num_threads` for this process. On a
            shared CPU use 1: tiny models gain nothing from intra-op threads,
            and spinning threads slow down badly (10x seen) when another
            process holds a core.
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    min_lr_ratio: float = 0.0
    micro_batch_size: int = 8
    num_mini_batches: int = 1
    num_epochs: int = 1
    advantage_estimator: str = "grpo"
    estimator_kwargs: dict[str, Any] = field(default_factory=dict)
    policy_loss: str = "ppo_clip"
    loss_kwargs: dict[str, Any] | None = None
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip_c: float | None = 3.0
    loss_agg: str = "token-mean"
    norm_len: int | None = None
    use_kl_loss: bool = False
    use_reference: bool = False
    teacher_path: str | None = None
    teacher_dtype: str = "float32"
    critic_lr: float | None = None
    critic_path: str | None = None
    critic_value_clip: float = 0.2
    critic_warmup_steps: int = 0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    tis_cap: float | None = None
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    num_threads: int | None = None
