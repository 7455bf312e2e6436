"""Optimizer and learning-rate schedule for the torch training backend.

Built once by the trainer from `TorchTrainerConfig`; the schedule advances
once per `train_step` (one rollout step), so `warmup_steps` and
`total_steps` count training steps as the recipe does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

SCHEDULES = ("constant", "cosine", "linear")


def build_optimizer(
    named_params: Iterable[tuple[str, torch.nn.Parameter]],
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters: decoupled weight decay on the weight matrices and embeddings,
    none on biases and norm weights (`decays`), as Megatron-LM and HF's Trainer do. On CUDA the fused
    kernel (one launch for every tensor); on CPU the single-tensor path, cheaper for a small model's many
    tiny tensors."""
    trainable = [(name, p) for name, p in named_params if p.requires_grad]
    groups = [{"params": [p for name, p in trainable if decays(name, p)], "weight_decay": weight_decay},
              {"params": [p for name, p in trainable if not decays(name, p)], "weight_decay": 0.0}]
    cuda = any(p.device.type == "cuda" for _, p in trainable)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps,
                             **({"fused": True} if cuda else {"foreach": False}))


def decays(name: str, param: torch.nn.Parameter) -> bool:
    """Whether weight decay applies: to tensors of two or more dimensions, not to biases and norm weights
    (one dimension each)."""
    return param.dim() >= 2 and not name.endswith(".bias")


def lr_lambda(
    schedule: str, *, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> Callable[[int], float]:
    """Multiplier of the peak lr at step s: linear warmup, then constant / cosine / linear decay.

    Warmup goes from 1/warmup_steps to 1 over `warmup_steps` steps (step 0
    never trains at lr 0). Decay runs from the end of warmup to
    `total_steps`, down to `min_lr_ratio`, and stays there afterwards.
    """
    if schedule not in SCHEDULES:
        raise ValueError(
            f"unknown lr_schedule '{schedule}'; valid: {', '.join(SCHEDULES)}"
        )
    if schedule != "constant" and total_steps <= warmup_steps:
        raise ValueError(
            f"lr_schedule '{schedule}' needs total_steps > warmup_steps (got {total_steps} <= {warmup_steps})"
        )

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        shape = (
            0.5 * (1.0 + math.cos(math.pi * progress))
            if schedule == "cosine"
            else 1.0 - progress
        )
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, **kwargs
) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` following `lr_lambda` (its state_dict holds the step count)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(schedule, **kwargs))
