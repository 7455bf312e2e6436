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
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (decoupled weight decay on all of them)."""
    trainable = [p for p in params if p.requires_grad]
    # foreach=False: the single-tensor path is cheaper for the many tiny tensors of small models on CPU.
    return torch.optim.AdamW(
        trainable, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, foreach=False
    )


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
