"""Outcome-reward advantages of the GRPO family, one per sample.

The per-sample formulas behind the registered estimators grpo, dr_grpo, rloo
and reinforce_pp_baseline (estimators.py broadcasts them to the response
tokens). Each maps per-sample rewards and group ids to one advantage per
sample. Formulas: docs/algorithms.md, "Advantage estimators".

Convention for a group of size 1 (shared by all three, as in verl): the group
mean is taken as 0 and the std as 1, so the sample's advantage is its reward
(divided by 1 + 1e-6 for grpo).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

GRPO_EPS = 1e-6


def group_stats(rewards: torch.Tensor, group_ids: Sequence[int] | torch.Tensor):
    """Per-sample group mean, unbiased group std and group size.

    Returns three tensors shaped like `rewards`. Groups of size 1 get mean 0
    and std 1 (see module docstring).
    """
    ids = torch.as_tensor(group_ids)
    _, inverse = torch.unique(ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(
        0, inverse, torch.ones_like(r)
    )
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, r)
    mean = (total / count)[inverse]
    sq_dev = torch.zeros(num_groups, dtype=torch.float64).index_add_(
        0, inverse, (r - mean) ** 2
    )
    n = count[inverse]
    std = torch.sqrt(sq_dev[inverse] / (n - 1).clamp(min=1))
    single = n == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean.to(rewards.dtype), std.to(rewards.dtype), n.to(rewards.dtype)


def grpo(
    rewards: torch.Tensor, group_ids: Sequence[int] | torch.Tensor
) -> torch.Tensor:
    """`A_i = (R_i - mean_g R) / (std_g R + 1e-6)`, std unbiased (Bessel)."""
    mean, std, _ = group_stats(rewards, group_ids)
    return (rewards - mean) / (std + GRPO_EPS)


def dr_grpo(
    rewards: torch.Tensor, group_ids: Sequence[int] | torch.Tensor
) -> torch.Tensor:
    """`A_i = R_i - mean_g R` (Dr. GRPO: no std normalisation)."""
    mean, _, _ = group_stats(rewards, group_ids)
    return rewards - mean


def rloo(
    rewards: torch.Tensor, group_ids: Sequence[int] | torch.Tensor
) -> torch.Tensor:
    """Leave-one-out baseline: `A_i = n/(n-1) (R_i - mean_g R)`; size-1 groups: `A_i = R_i`."""
    mean, _, n = group_stats(rewards, group_ids)
    return (rewards - mean) * torch.where(
        n > 1, n / (n - 1).clamp(min=1), torch.ones_like(n)
    )
