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
        num_mini_batches: optimizer steps per pass over a train step's samples
            (each rank's shard is split into this many contiguous mini-batches);
            the recipe's samples per step // `train.global_batch_size`.
            1 (with `num_epochs` 1) = one update, where the ratio pi/pi_old is 1
            and no clip acts.
        num_epochs: passes over the step's samples (`train.ppo_epochs`).
        algorithm: the recipe's `algorithm.name`; its spec (config/algorithm_specs.py)
            says which estimator, policy loss and token selection to use.
        estimator_kwargs: the estimator's keyword arguments (`AlgorithmConfig.estimator_kwargs()`);
            a `kl_coef` > 0 puts the KL to the reference into the token rewards.
        loss_kwargs: the policy loss's keyword arguments (`AlgorithmConfig.loss_kwargs()`);
            empty = the loss function's own defaults.
        selection_kwargs: the token selection's (`AlgorithmConfig.selection_kwargs()`).
        loss_agg: "token-mean", "seq-mean-token-sum", "seq-mean-token-mean"
            or "seq-mean-token-sum-norm"; None = the spec's.
        norm_len: constant length for "seq-mean-token-sum-norm"; None = the
            longest response of the step.
        use_kl_loss: add `kl_coef * agg(kl)` against a frozen reference model.
        use_reference: build the reference model even without the KL loss
            (KL in the reward).
        reference_service: the reference log-probs come from the reference
            service (fully_async) with each step's samples; no reference model
            is loaded here.
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
        dtype: parameter dtype, "float32" or "bfloat16" (log-softmax is always float32); with
            `fsdp` the compute dtype, the parameters being float32 master weights.
        device: torch device string ("cpu" here; "cuda" on a GPU node).
        fsdp: shard the policy over the data-parallel ranks with FSDP2 (train/sharding.py).
        recompute_activations: recompute each decoder layer's activations in the backward pass.
        freeze_vision / freeze_audio: the vision / audio encoder keeps its initial weights (no gradient, no
            optimizer state, not sent to the engines).
        max_tokens_per_micro_batch: micro-batches hold at most this many tokens (and at most
            `micro_batch_size` samples), packed into one row without padding; None: padded
            micro-batches of `micro_batch_size` samples.
        trust_remote_code: let the policy, reference, teacher and critic models
            run the code their HF directories ship (`model.trust_remote_code`).
        samples_per_step: the recipe's samples per training step (the Megatron backend saves its schedule
            in samples, as Megatron-LM counts it); 0: unknown, counted in steps.
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
    algorithm: str = "grpo"
    estimator_kwargs: dict[str, Any] = field(default_factory=dict)
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    selection_kwargs: dict[str, Any] = field(default_factory=dict)
    loss_agg: str | None = None
    norm_len: int | None = None
    use_kl_loss: bool = False
    use_reference: bool = False
    reference_service: bool = False
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
    fsdp: bool = False
    recompute_activations: bool = False
    freeze_vision: bool = False
    freeze_audio: bool = False
    max_tokens_per_micro_batch: int | None = None
    trust_remote_code: bool = False
    num_threads: int | None = None
    samples_per_step: int = 0
